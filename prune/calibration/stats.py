"""Per-layer statistics of the FFN's intermediate activations h (the down projection's input).

Over the calibration tokens: the count, sum h, sum h^2, sum |h| and, where a least-squares fit
needs it, the Gram matrix H^T H. Both forwards gather these (llama_stats.py, reference_stats.py);
every importance method and the least-squares compensation read them (dense/methods.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class LayerStats:
    count: int
    sum: np.ndarray       # (n_ff,)
    sumsq: np.ndarray     # (n_ff,)
    sumabs: np.ndarray    # (n_ff,)
    gram: np.ndarray      # (n_ff, n_ff) float64, sum over tokens of h h^T (or of w_t h h^T, see below)
    #: where the Gram matrix is token-weighted (llama_stats.FFNInputProbe), its bias row and corner:
    #: sum w_t h_t and sum w_t; None where it is not weighted (then sum and count)
    gram_sum: np.ndarray | None = None
    gram_count: float | None = None

    @property
    def mean(self) -> np.ndarray:
        return self.sum / self.count

    @property
    def var(self) -> np.ndarray:
        return np.maximum(self.sumsq / self.count - self.mean ** 2, 0.0)
