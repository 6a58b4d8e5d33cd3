"""One pass of the torch reference forward of the unpruned model over calibration text: per-layer FFN statistics.

For every layer, with h = silu(gate x) * up x (the FFN's intermediate activations, one row per
token) it accumulates the count, sum h, sum h^2, sum |h| and the Gram matrix H^T H, which every
importance method and the least-squares compensation need. Results are cached on disk, keyed by
the source file, the calibration tokens and the format version, so a second run (or a run after
an interrupt) skips the pass.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import require_torch
from ..files import save_npz_atomic
from .stats import LayerStats

STATS_VERSION = 1


@dataclass
class CalibrationStats:
    layers: list[LayerStats]
    tokens: np.ndarray           # (n_windows, seq_len) int32
    key: str


def stats_key(source_sha256: str, tokens: np.ndarray) -> str:
    h = hashlib.sha256(f"v{STATS_VERSION}:{source_sha256}:".encode())
    h.update(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
    return h.hexdigest()[:24]


def _save(path: Path, st: CalibrationStats) -> None:
    arrays = {"tokens": st.tokens, "count": np.array([ls.count for ls in st.layers])}
    for i, ls in enumerate(st.layers):
        arrays[f"sum{i}"], arrays[f"sumsq{i}"], arrays[f"sumabs{i}"] = ls.sum, ls.sumsq, ls.sumabs
        arrays[f"gram{i}"] = ls.gram.astype(np.float32)
    save_npz_atomic(path, arrays)


def _load(path: Path, key: str) -> CalibrationStats | None:
    try:
        z = np.load(path)
        n = len(z["count"])
        layers = [LayerStats(int(z["count"][i]), z[f"sum{i}"], z[f"sumsq{i}"], z[f"sumabs{i}"],
                             z[f"gram{i}"].astype(np.float64)) for i in range(n)]
        return CalibrationStats(layers, z["tokens"], key)
    except (OSError, KeyError, ValueError):
        return None  # a damaged cache file is recomputed


def collect(model, windows: list[list[int]], source_sha256: str, cache_dir: str | os.PathLike | None = None,
            progress: bool = True, batch: int = 4) -> CalibrationStats:
    """Run the teacher over `windows` (equal lengths) and gather statistics (cached when cache_dir)."""
    torch = require_torch()
    tokens = np.array(windows, dtype=np.int32)
    key = stats_key(source_sha256, tokens)
    path = Path(cache_dir) / f"calib-{key}.npz" if cache_dir else None
    if path is not None and path.is_file():
        st = _load(path, key)
        if st is not None:
            return st
    widths = model.ffn_widths
    z = dict(dtype=torch.float64, device=model.device)
    acc = [dict(count=0, sum=torch.zeros(w, **z), sumsq=torch.zeros(w, **z), sumabs=torch.zeros(w, **z),
                gram=torch.zeros(w, w, **z))
           for w in widths]

    def hook(il: int, h, a):
        x = h.reshape(-1, h.shape[-1]).double()
        a = acc[il]
        a["count"] += x.shape[0]
        a["sum"] += x.sum(0)
        a["sumsq"] += (x * x).sum(0)
        a["sumabs"] += x.abs().sum(0)
        xf = h.reshape(-1, h.shape[-1])
        a["gram"] += (xf.T @ xf).double()
        return None

    from tqdm import tqdm

    bar = tqdm(total=len(windows), desc="calibrating", unit="seq", disable=not progress)
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(tokens[i:i + batch].astype(np.int64))
            model.hidden(x, hook)
            bar.update(x.shape[0])
    bar.close()
    layers = [LayerStats(a["count"], a["sum"].cpu().numpy(), a["sumsq"].cpu().numpy(), a["sumabs"].cpu().numpy(),
                         a["gram"].cpu().numpy())
              for a in acc]
    st = CalibrationStats(layers, tokens, key)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _save(path, st)
    return st
