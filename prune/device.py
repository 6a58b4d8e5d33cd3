"""Where the torch parts of pruning run: `--device cuda|cpu|auto`.

`auto` takes the GPU when torch sees one and says so in a log line either way; `cuda` without one
is a clear error (a CPU-only torch build, or no device). bf16 autocast is used on CUDA for the
forward passes of distillation (teacher and student); statistics, least-squares fits and the
exported weights stay in float32/float64.
"""
from __future__ import annotations

import contextlib
import logging

from .errors import InvalidRequest, require_torch

log = logging.getLogger("comfyui_a3b.prune")

#: the `device` choices of every torch part (pruning, recovery, adapter training)
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str = "auto") -> str:
    """'cpu' or 'cuda' for a `--device` value."""
    if name not in DEVICES:
        raise InvalidRequest(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cpu":
        return "cpu"
    torch = require_torch()
    available = bool(torch.cuda.is_available())
    if name == "cuda":
        if not available:
            why = ("this torch build has no CUDA support" if torch.version.cuda is None
                   else "torch finds no CUDA device")
            raise InvalidRequest(f"--device cuda asks for a GPU, but {why}. Use --device cpu (or auto), or "
                                 "install a CUDA build of torch on a machine with an NVIDIA GPU.")
        return "cuda"
    if available:
        log.info("pruning: torch parts run on the GPU (%s)", torch.cuda.get_device_name(0))
        return "cuda"
    log.info("pruning: no CUDA device for torch, the torch parts run on the CPU")
    return "cpu"


def autocast(device: str, enabled: bool = True):
    """bf16 autocast on CUDA (where the GPU's bf16 matrix units pay), nothing elsewhere."""
    if device != "cuda" or not enabled:
        return contextlib.nullcontext()
    torch = require_torch()
    return torch.autocast("cuda", dtype=torch.bfloat16)


def synchronize(device: str) -> None:
    if device == "cuda":
        require_torch().cuda.synchronize()


def matmul_speed(seconds: float = 0.3) -> float:
    """Floating-point operations per second of float32 matrix products on this machine's CPU, measured
    for about `seconds` with the shapes of a small model's layers (for a time estimate, not a benchmark)."""
    import time

    torch = require_torch()
    a, b = torch.randn(1024, 576), torch.randn(576, 1536)
    a @ b  # warm-up: the first product sets up threads
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        a @ b
        n += 1
    return 2.0 * 1024 * 576 * 1536 * n / dt
