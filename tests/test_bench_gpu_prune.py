"""The GPU pruning benchmark at a tiny shape on the CPU, with torch made unimportable (as on a GPU
machine without it)."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_gpu_prune_bench_runs_at_a_tiny_shape_without_torch(tmp_path):
    import os

    from comfyui_a3b.bench.bench_gpu_prune import main

    vet = os.environ.get("A3B_VET")
    rc = main(["--out", str(tmp_path), "--shape", "tiny", "--keeps", "0.8", "--calib-windows", "4", "--seq-len", "64",
               "--prefill-tokens", "128", "--decode-tokens", "8", "--reps", "1", "--block-torch",
               "--n-gpu-layers", "0"])
    assert rc == 0
    assert os.environ.get("A3B_VET") == vet  # crafted-file tests later in the session rely on vetting
    r = json.loads((tmp_path / "bench_gpu_prune.json").read_text())
    c = r["prunes"]["wanda@0.8"]
    assert c["n_ff"] == 416 and c["peak_rss"] > c["peak_anon"] > 0 and c["wall_s"] > 0
    assert set(r["speed"]) == {"unpruned", "wanda@0.8"}
    assert all(v["decode_tps"] > 0 and v["prefill_tps"] > 0 for v in r["speed"].values())
    assert "| wanda@0.8 | 416 |" in (tmp_path / "bench_gpu_prune.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_gpu_prune.json", "bench_gpu_prune.md",
                                                          "bench_gpu_prune.png"]


def test_gpu_prune_bench_prunes_experts_of_a_tiny_moe_shape(tmp_path):
    from comfyui_a3b.bench.models import SHAPES, write_model
    from comfyui_a3b.bench.bench_gpu_prune import main

    model = write_model(tmp_path / "moe.gguf", SHAPES["tiny-moe"])
    out = tmp_path / "out"
    rc = main(["--out", str(out), "--shape", "tiny-moe", "--model", str(model), "--experts-keeps", "0.75,0.5",
               "--calib-windows", "4", "--seq-len", "64", "--prefill-tokens", "128", "--decode-tokens", "8",
               "--reps", "1", "--block-torch", "--n-gpu-layers", "0"])
    assert rc == 0
    r = json.loads((out / "bench_gpu_prune_moe.json").read_text())
    assert {k: c["n_expert"] for k, c in r["prunes"].items()} == {"reap@experts 0.75": 12, "reap@experts 0.5": 8}
    sizes = [r["model_bytes"]] + [c["bytes"] for c in r["prunes"].values()]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3
    assert all(v["load_s"] > 0 and v["decode_tps"] > 0 for v in r["speed"].values())
    assert model.is_file()   # a model given with --model is the caller's: left in place
    assert "| reap@experts 0.5 | 8 |" in (out / "bench_gpu_prune_moe.md").read_text()
