"""The A3B sidebar's placement lines (web/a3b.js renderStatus), run in Node with the stand-ins of
test_web_reasoning (fast tier): what went where, device memory expected and measured, the last hand-over."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from test_web_reasoning import HARNESS, JS


PLACEMENT = r"""
const st = { rss_bytes: 1, memory_bytes: 1, weight_loads: 1, cache_hits: 0, evictions: 0, llama_cpp_python: "x",
  vram: { policy: "offload",
    managed: [{ handovers: [{ before_bytes: 8 * 2 ** 30, gpu_bytes: 6 * 2 ** 30, seconds: 1.5 }] }] },
  models: [{ name: "m.gguf", path: "/m.gguf", architecture: "qwen3moe", spec: { n_ctx: 2048 }, offload: "auto: ...",
    placement: { gpu: true, moe: true, n_gpu_layers: 49, n_layer: 48, n_cpu_moe: 20, speed: "experts-cpu",
      gpu_bytes: 6 * 2 ** 30, host_bytes: 10 * 2 ** 30, measured: { gpu_bytes: 6.5 * 2 ** 30 } } }] };
console.log(JSON.stringify({ html: mod.renderStatus(st), cpu: mod.placementLine({ gpu: false }) }));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_the_sidebar_shows_the_placement_expected_and_measured_and_the_last_hand_over(tmp_path):
    script = tmp_path / "t.mjs"
    head, imp = HARNESS.split("const mod = ")
    script.write_text(head + "globalThis.__stubs = stubs;\nconst mod = " + imp + PLACEMENT)
    out = subprocess.run(["node", str(script), str(JS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert ("placement: 48/48 layers on the GPU, experts of 20/48 layers in RAM (experts-cpu); VRAM expected "
            "6.00 GB, measured 6.50 GB; RAM 10.00 GB") in got["html"]
    assert "last hand-over: 2.00 GB given back by a smaller placement in 1.5 s" in got["html"]
    assert got["cpu"] == ""
