"""The dynamic (token-level) FFN gate, in the torch reference forward only.

Per token and layer, FFN neurons whose |silu(gate x)| falls below a per-layer threshold are
switched off (CATS-style; TEAL thresholds the matmul inputs instead). Thresholds are calibrated per
layer as the quantile of |silu(gate x)| on calibration text that gives the target sparsity, and are
stored in the GGUF as `a3b.gate.*` metadata.

llama.cpp cannot use this gate for speed: its matmul kernels compute every row of ffn_up/ffn_down
for every token, and it has no per-token sparse FFN kernel. The gate saves compute only in a runtime
with such kernels (CATS and TEAL ship custom GPU kernels); here it is measured for quality.
"""
from __future__ import annotations

import numpy as np

from ..errors import require_torch


def calibrate_thresholds(model, windows: np.ndarray, sparsity: float, max_samples: int = 400_000,
                         seed: int = 0) -> list[float]:
    """Per-layer thresholds on |silu(gate x)| that switch off `sparsity` of the neurons on average."""
    torch = require_torch()
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"gate sparsity must be in [0, 1), got {sparsity}")
    gen = torch.Generator(device=model.device).manual_seed(seed)
    samples: list[list] = [[] for _ in model.layers]

    def hook(il, h, a):
        v = a.detach().abs().flatten()
        if v.numel() > max_samples // 4:
            v = v[torch.randint(0, v.numel(), (max_samples // 4,), generator=gen, device=v.device)]
        samples[il].append(v)
        return None

    with torch.no_grad():
        for w in windows:
            model.hidden(torch.as_tensor(np.asarray(w, dtype=np.int64)), hook)
    return [float(torch.quantile(torch.cat(s)[:max_samples].float(), sparsity)) if sparsity > 0 else 0.0
            for s in samples]


def gate_hook(thresholds: list[float], counter: dict | None = None):
    """A reference-forward hook that applies the gate (and counts the switched-off fraction)."""
    torch = require_torch()

    def hook(il, h, a):
        mask = a.abs() >= thresholds[il]
        if counter is not None:
            counter["off"] = counter.get("off", 0) + int((~mask).sum())
            counter["all"] = counter.get("all", 0) + mask.numel()
        return torch.where(mask, h, torch.zeros_like(h))

    return hook
