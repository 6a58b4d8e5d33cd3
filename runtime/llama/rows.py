"""The output rows of a decode step, sampled on the CPU: each request's next token, and the entropy
of the model's distribution where confidence spans are asked for.

A row is n_vocab logits (152k floats for Qwen: 600 KB). The entropy is three passes over it (the
maximum, exp, a dot product), about 0.3-0.7 ms per row on one core, mostly exp: at 16 requests on a
GPU, done row after row, that was 14 ms a step against 9 ms for the decode itself. So the work of a
step's rows runs side by side in the backend's sampling threads (numpy and ctypes release the GIL)
as soon as several rows have such work, and every thread computes in two buffers of its own (a
fresh 600 KB array per row costs page faults on every use). The numbers are the same as one row
after another: the same float32 operations in the same order.

A sampler chain that starts with top-k (the default chain at temperature > 0, llama.vim's), or with
a repeat penalty before the likeliest token (temperature 0), draws from the row's few likeliest
tokens (chain.candidates says how many), but llama.cpp's `llama_sampler_sample` first copies the
whole row into n_vocab (id, logit, p) records and runs the chain over all of them: 0.2-0.3 ms per
row of 152k, 0.7-0.8 ms with the penalty first (bench_draw). `top_candidates` finds a small set that
holds the top k in two vectorised passes, and `draw` hands only those to the same chain
(`llama_sampler_apply`, then `llama_sampler_accept`, as llama_sampler_sample does): the chain's
top-k keeps the same k tokens in the same order, and the penalty's likeliest token is the same one,
so the same token is drawn for the same seed, in about 0.08 ms a row (0.13 ms on an H200's host,
where the row comes fresh from the device's copy). Where logits tie at the k-th place, either draw
keeps one of the tied tokens.

Finding the candidates in the graph instead (a top-k chain of llama.cpp's on every sequence, so no
row is copied back) was measured and not kept: the graph's sort of each row cost the GPU about what
the pass here costs, and through `a3b serve` it lost at 1, 4 and 16 clients (bench_graph_topk.py,
docs/figures.md).
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

#: Rows handed to threads from this many on (fewer are faster one after another)
THREADS_FROM = 4


#: llama.cpp's llama_token_data
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
#: top_candidates' groups of the row: GROUP tokens each (a stride of n_vocab // GROUP apart)
GROUP = 64


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.z: np.ndarray | None = None
        self.e: np.ndarray | None = None
        self.cand = np.empty(512, TOKEN_DATA)

    def buffers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self.z is None or self.z.shape[0] != n:
            self.z, self.e = np.empty(n, np.float32), np.empty(n, np.float32)
        return self.z, self.e

    def candidates(self, n: int) -> np.ndarray:
        if self.cand.shape[0] < n:
            self.cand = np.empty(n, TOKEN_DATA)
        return self.cand[:n]


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


def heavy(want_entropy: bool, greedy: bool, backend: bool, candidates: int) -> bool:
    """Whether a row's work is worth a thread: an entropy, or a sampler chain over the whole row (a
    greedy row alone is an argmax, a backend row one integer to read, a draw from the row's top-k
    candidates a few numpy calls: each of them takes the GIL again, and such rows in threads of
    their own lost to one thread for all; at 16 rows on an H200 1112-1262 against 1249-1313 tokens/s.
    Only their one read of the whole row (the groups' maxima, or a greedy row's argmax) in the
    threads lost too: 2.8-3.2 ms of sampling a 16-row step against 2.0 on the worker, and 1204-1326
    against 1360-1368 tokens/s; greedy 1782-1892 against 1962-2105)."""
    return not backend and (want_entropy or not (greedy or candidates))


def top_candidates(logits: np.ndarray, k: int) -> np.ndarray | None:
    """Ascending ids of a set of tokens that holds the row's k likeliest, or None where the whole
    row is cheaper (a top-k near the vocabulary's size, a row with NaN, many ties at the threshold).

    The row's first n // GROUP * GROUP tokens are laid out as GROUP slices of `groups` tokens, so a
    group is every groups-th token from a start, and one elementwise maximum over the slices gives
    every group's maximum; `t` is the k-th largest of those. k groups hold a token at t or above, so
    the row's k-th largest logit is at least t, and every token of the top k is at t or above: in a
    group whose maximum reaches t, or among the last n % GROUP tokens. On a language model's row
    that is k to a few more tokens, found in about 50 us for 152k logits."""
    n = logits.shape[0]
    groups = n // GROUP
    if k <= 0 or groups < 4 * k:
        return None
    m = groups * GROUP
    grid = logits[:m].reshape(GROUP, groups)
    maxima = grid.max(axis=0)
    if np.isnan(maxima).any():
        return None
    t = np.partition(maxima, groups - k)[groups - k]
    reach = np.flatnonzero(maxima >= t)
    if reach.shape[0] > groups // 4:
        return None
    at, col = np.nonzero(grid[:, reach] >= t)
    ids = at * groups + reach[col]
    if m < n:
        ids = np.concatenate((ids, m + np.flatnonzero(logits[m:] >= t)))
    ids.sort()
    return ids


def draw(L, chain, logits: np.ndarray, ids: np.ndarray) -> int:
    """The token that `chain` (a llama.cpp sampler chain whose answer comes from the row's tokens
    that `ids` holds: chain.candidates) draws from `logits`, accepted into the chain as
    llama_sampler_sample accepts it."""
    return draw_among(L, chain, ids, logits[ids])


def draw_among(L, chain, ids: np.ndarray, values: np.ndarray) -> int:
    """The token that `chain` draws from the candidates `ids` (ascending) with logits `values`,
    accepted into the chain: `draw`'s work once the candidates' logits are gathered (or come from
    elsewhere: bench_graph_topk's top-k in the graph)."""
    cand = _scratch.candidates(ids.shape[0])
    cand["id"] = ids
    cand["logit"] = values
    cand["p"] = 0.0
    arr = L.llama_token_data_array(cand.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), ids.shape[0], -1, False)
    L.llama_sampler_apply(chain, ctypes.byref(arr))
    if not 0 <= arr.selected < arr.size:
        raise ValueError(f"the sampler chain selected candidate {arr.selected} of {arr.size}")
    tok = int(cand["id"][arr.selected])
    L.llama_sampler_accept(chain, tok)
    return tok
