"""The LLM beside a diffusion model in ComfyUI's real model management: the hand-over measured.

    python3 -m comfyui_a3b.bench.bench_offload_comfy --comfyui COMFYUI_DIR --model FILE.gguf --out FILE.json

Run by bench_offload (in a child process, under its largest VRAM budget) where ComfyUI's sources
are given (`--comfyui`, or $COMFYUI_DIR); needs torch and what `comfy.model_management` and
`comfy.model_patcher` import (psutil, safetensors, pillow, numpy). Steps, each timed:

1. ComfyUI's model management imported, our models registered in it (nodes/vram.py `install`),
   the LLM loaded with the planner's placement, its decode tokens/s;
2. a model of SDXL's UNet size with uninitialised weights (`--diffusion-gb`, fp16 `nn.Linear`s) wrapped in
   ComfyUI's own `ModelPatcher` and loaded with `load_models_gpu`, the way ComfyUI loads a
   checkpoint: its `free_memory` asks our model for VRAM (`model_unload(memory_to_free)`), which
   first moves to a smaller placement; what the hand-over did and took;
3. an LLM generation in that placement (decode tokens/s);
4. the diffusion step again (`load_models_gpu`, one pass through every layer), then the LLM again.

Any step that fails (an out-of-memory included) is recorded with its error. On a machine without a
GPU, ComfyUI runs with --cpu and never asks our model for memory: the path is checked, nothing more.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .common import arguments, model_option

GIB = 1 << 30


def _decode(rt, spec, n: int = 32) -> float:
    from comfyui_a3b.runtime import ConfidenceConfig, preset

    from .models import prompt

    t = time.perf_counter()
    r = rt.generate(prompt_tokens=prompt(16, 9), model=spec, chat=False, max_tokens=n, sampling=preset("greedy"),
                    confidence=ConfidenceConfig(enabled=False))
    return r.n_tokens / (time.perf_counter() - t)


def _placement(rt, spec) -> dict:
    m = rt.loaded(spec)
    if m is None:
        return {"loaded": False}
    p = m.info.placement
    return {"loaded": True, "offload": m.info.offload, "n_gpu_layers": m.info.n_gpu_layers,
            "n_cpu_moe": m.info.n_cpu_moe, "gpu_bytes_expected": p.get("gpu_bytes"),
            "gpu_bytes_measured": p.get("measured", {}).get("gpu_bytes")}


def diffusion_model(gb: float):
    """A module of `gb` GB of fp16 weights in 128 MiB linear layers (uninitialised: fast to make)."""
    import torch

    n = max(1, int(gb * 1e9 / (8192 * 8192 * 2)))
    meta = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192, bias=False, dtype=torch.float16, device="meta")
                                 for _ in range(n)])
    return meta.to_empty(device="cpu")   # no initialisation pass over gigabytes: the values do not matter


def step(out: dict, name: str, fn):
    t = time.perf_counter()
    try:
        out[name] = {**(fn() or {}), "seconds": time.perf_counter() - t}
    except Exception as e:  # noqa: BLE001 - recorded, the next step still runs
        out[name] = {"error": f"{type(e).__name__}: {e}"[:800], "seconds": time.perf_counter() - t}
    print(f"{name}: {json.dumps(out[name], default=str)[:400]}", flush=True)


def run(comfyui: Path, model: Path, gb: float, n_ctx: int) -> dict:
    sys.path.insert(0, str(comfyui))
    # our runtime first: llama.cpp's libraries load before torch's C++ runtime, the order our own
    # processes use (inside ComfyUI torch comes first; see docs/gpu.md on the build that works there)
    from comfyui_a3b.runtime import get_runtime
    import torch
    import comfy.cli_args

    if not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True      # ComfyUI's --cpu
    import comfy.model_management as mm
    import comfy.model_patcher as mp
    import folder_paths  # noqa: F401 - with model management loaded, what marks a running ComfyUI

    from comfyui_a3b.nodes import vram

    out: dict = {"device": str(mm.get_torch_device()), "policy": vram.policy(), "diffusion_gb": gb}
    assert vram.install()
    rt = get_runtime()
    spec = rt.spec(str(model), n_ctx=n_ctx, n_parallel=1)

    def load_llm():
        rt.load(spec)
        return {**_placement(rt, spec), "decode_tps": _decode(rt, spec),
                "free_after": mm.get_free_memory(mm.get_torch_device())}

    step(out, "llm_load", load_llm)
    patcher = mp.ModelPatcher(diffusion_model(gb), load_device=mm.get_torch_device(),
                              offload_device=torch.device("cpu"))

    def load_diffusion():
        before = mm.get_free_memory(mm.get_torch_device())
        mm.load_models_gpu([patcher])
        entries = vram.status()["managed"]
        return {"free_before": before, "free_after": mm.get_free_memory(mm.get_torch_device()),
                "handovers": [h for e in entries for h in e["handovers"]], "llm": _placement(rt, spec),
                "comfyui_models": [type(m.model).__name__ if hasattr(m, "model") else str(m)
                                   for m in mm.current_loaded_models]}

    def sample():
        x = torch.randn(8, 8192, dtype=torch.float16, device=mm.get_torch_device())
        with torch.no_grad():
            for layer in patcher.model:
                x = torch.nn.functional.normalize(layer(x), dim=-1)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        return {}

    step(out, "diffusion_load", load_diffusion)
    step(out, "llm_generate", lambda: {**_placement(rt, spec), "decode_tps": _decode(rt, spec)})
    step(out, "diffusion_again", lambda: {**load_diffusion(), **(sample() or {})})
    step(out, "llm_again", lambda: {**_placement(rt, spec), "decode_tps": _decode(rt, spec)})
    rt.unload()
    return out


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_DIR"), required=os.environ.get("COMFYUI_DIR") is None)
    model_option(ap, help="the GGUF to load", required=True)
    ap.add_argument("--diffusion-gb", type=float, default=5.1, help="SDXL's UNet in fp16: 2.6B parameters")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("A3B_VET", "off")
    res = run(Path(args.comfyui), Path(args.model), args.diffusion_gb, args.n_ctx)
    Path(args.out).write_text(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
