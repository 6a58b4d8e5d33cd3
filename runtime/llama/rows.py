"""The output rows of a decode step, sampled on the CPU: each request's next token, and the entropy
of the model's distribution where confidence spans are asked for.

A row is n_vocab logits (152k floats for Qwen: 600 KB). The entropy is three passes over it (the
maximum, exp, a dot product), about 0.3-0.7 ms per row on one core, mostly exp: at 16 requests on a
GPU, done row after row, that was 14 ms a step against 9 ms for the decode itself. So the work of a
step's rows runs side by side in the backend's sampling threads (numpy and ctypes release the GIL)
as soon as several rows have such work, and every thread computes in two buffers of its own (a
fresh 600 KB array per row costs page faults on every use). The numbers are the same as one row
after another: the same float32 operations in the same order.
"""
from __future__ import annotations

import threading

import numpy as np

#: Rows handed to threads from this many on (fewer are faster one after another)
THREADS_FROM = 4


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.z: np.ndarray | None = None
        self.e: np.ndarray | None = None

    def buffers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self.z is None or self.z.shape[0] != n:
            self.z, self.e = np.empty(n, np.float32), np.empty(n, np.float32)
        return self.z, self.e


_scratch = _Scratch()


def entropy(logits: np.ndarray) -> float:
    """Shannon entropy (nats) of softmax(logits)."""
    if logits.dtype != np.float32:
        logits = logits.astype(np.float32)
    z, e = _scratch.buffers(logits.shape[0])
    np.subtract(logits, logits.max(), out=z)
    np.exp(z, out=e)
    s = e.sum()
    return float(np.log(s) - np.dot(e, z) / s)


def heavy(want_entropy: bool, greedy: bool, backend: bool) -> bool:
    """Whether a row's work is worth a thread: an entropy, or a sampler chain over the whole row
    (a greedy row alone is an argmax, a backend row one integer to read)."""
    return not backend and (want_entropy or not greedy)
