"""bench_vision end to end at the tiny shape on the CPU, with a stand-in for llama-mtmd-cli that
checks its command line and prints what the real one logs: the run the GPU machine makes, small."""
from __future__ import annotations

import json
import stat
import sys

import pytest

from comfyui_a3b.bench import bench_vision

pytestmark = pytest.mark.slow

FAKE_CLI = """#!{python}
import sys
args = sys.argv[1:]
need = ["-m", "--mmproj", "-p", "-n", "-c", "-ngl", "--chat-template"]
missing = [a for a in need if a not in args]
images = [args[i + 1] for i, a in enumerate(args) if a == "--image"]
if missing or not images:
    print("bad arguments", missing, file=sys.stderr)
    sys.exit(3)
for i, _ in enumerate(images):
    print("encoding image slice...", file=sys.stderr)
    print(f"mtmd batch encoding done in {{10 + i}} ms", file=sys.stderr)
    print(f"image decoded (batch 1/1) in {{3 + i}} ms", file=sys.stderr)
print("x")
"""


def test_the_benchmark_runs_at_the_tiny_shape_and_compares_with_the_cli(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cli = bin_dir / "llama-mtmd-cli"
    cli.write_text(FAKE_CLI.format(python=sys.executable))
    cli.chmod(cli.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    assert bench_vision.main(["--out", str(out), "--pair", "tiny", "--images", "2", "--bin", str(bin_dir)]) == 0
    res = json.loads((out / "bench_vision.json").read_text())
    ours, ref = res["ours"], res["mtmd_cli"]
    assert "error" not in ours and "error" not in ref, (ours, ref)
    assert len(ours["encode_ms"]) == 2 and ours["image_tokens"] > 0
    assert ref["encode_ms"] == [10.0, 11.0] and res["encode_ratio_vs_mtmd_cli"] == ours["encode_ms_median"] / 10.5
    assert ours["first_token_requeue_ms_median"] < ours["first_token_image_ms_median"]
    assert (out / "bench_vision.md").read_text().count("|") > 10 and (out / "bench_vision.png").exists()


def test_encode_times_are_read_from_llama_mtmd_clis_log():
    from comfyui_a3b.bench.bench_vision import encode_times

    log = ("0.01.113.388 I encoding mtmd batch, n_chunks = 1 (done = 1, total = 13)\n"
           "0.01.223.808 I mtmd batch encoding done in 110 ms\n"
           "0.01.270.403 I mtmd batch encoding done in 28 ms\n"
           "image slice encoded in 7 ms\n")
    assert encode_times(log) == [110.0, 28.0, 7.0]
