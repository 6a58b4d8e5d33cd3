"""FFN-neuron importance and selection: random, magnitude, wanda, flap and a3b.

Every method keeps the same number `k` of neurons in every layer (llama.cpp builds the layers of
llama/qwen2/qwen3 from one FFN width). Notation per layer: gate, up (n_ff, n_embd), down
(n_embd, n_ff), h = silu(gate x) * up x the intermediate activation, from calibration statistics.

- random:    a seeded random subset (the floor any method must beat).
- magnitude: ||gate_i|| * ||up_i|| * ||down_:,i||, weights only, no data.
- wanda:     ||down_:,i|| * ||h_i||_2 over calibration tokens (Wanda's |W| * ||x|| at neuron level).
- flap:      Var(h_i) * ||down_:,i||^2 (FLAP's fluctuation), plus its bias compensation: the pruned
             neurons' mean output goes into ffn_down.bias (llama only: qwen2/qwen3 files cannot carry
             that bias, so there it is selection only).
- obs:       structured optimal-brain-surgeon on the FFN output. With G = H^T H from calibration,
             removing neuron i and re-fitting the remaining down columns by least squares costs
             ||down_:,i||^2 / [G^-1]_ii; the cheapest neurons are removed and the remaining columns
             updated, a few at a time. For llama a constant input (the bias) is part of the fit,
             which generalises FLAP's compensation to the re-fitted least-squares optimum.
- a3b:       obs done sequentially and error-correcting: each layer is fitted on the inputs the
             already-pruned earlier layers give it, to the output that brings the residual stream
             back to the unpruned model's (sequential.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..calibration.stats import LayerStats


@dataclass
class LayerPlan:
    keep: np.ndarray                 # sorted indices of kept neurons
    down: np.ndarray | None          # new (n_embd, k) down weights, None = original columns
    bias: np.ndarray | None          # new ffn_down.bias (n_embd,), None = none


def scores(method: str, gate: np.ndarray | None, up: np.ndarray | None, down: np.ndarray, st: LayerStats | None,
           rng: np.random.Generator) -> np.ndarray:
    dn = np.linalg.norm(down, axis=0)
    if method == "random":
        return rng.random(down.shape[1])
    if method == "magnitude":
        g = np.linalg.norm(gate, axis=1) if gate is not None else 1.0
        return g * np.linalg.norm(up, axis=1) * dn
    if st is None:
        raise ValueError(f"method {method!r} needs calibration statistics")
    if method == "wanda":
        return dn * np.sqrt(st.sumsq)
    if method == "flap":
        return st.var * dn ** 2
    raise ValueError(f"no plain score for method {method!r}")


def top(score: np.ndarray, k: int) -> np.ndarray:
    """The indices of the `k` highest scores, in ascending order (ties: the lower index)."""
    return np.sort(np.argsort(-np.asarray(score), kind="stable")[:k])


def obs_chunk(n: int) -> int:
    """Neurons removed per OBS step: 8 for small FFNs, about n/256 for wide ones (12288 -> 48)."""
    return max(8, n // 256)


def obs_prune(W, Hinv, n: int, k: int, fit_bias: bool, chunk: int = 8) -> LayerPlan:
    """Remove n - k of the first n columns of W (torch float64, (n_out, m); updated in place), Hinv
    the inverse of the damped Gram matrix G (updated in place: the caller gives it away).

    W must be the least-squares optimum for G (the current weights, when the target is the layer's own
    output). Removing the `chunk` cheapest neurons together is an exact block-OBS update for that
    set; only the choice of the set is greedy. Column n (the bias, when fitted) is never removed.
    """
    import torch

    m = Hinv.shape[0]
    alive = torch.ones(m, dtype=torch.bool, device=W.device)
    protected = torch.zeros(m, dtype=torch.bool, device=W.device)
    if fit_bias:
        protected[n] = True
    left = n - k
    # One scratch matrix the size of W for the squares and the update: a fresh (n_out, m) temporary
    # per step was mapped and faulted in anew each time (large blocks go back to the system at once,
    # runtime/models/memory.py), which was most of the method's time; the same operations in the same order.
    scratch = torch.empty_like(W)
    while left > 0:
        c = min(chunk, left)
        sal = torch.mul(W, W, out=scratch).sum(0) / Hinv.diagonal()
        sal[~alive | protected] = float("inf")
        S = torch.topk(sal, c, largest=False).indices
        Hss_inv = torch.linalg.inv(Hinv[S][:, S])
        HS = Hinv[S]
        W.sub_(torch.mm(W[:, S] @ Hss_inv, HS, out=scratch))
        Hinv.addmm_(HS.T @ Hss_inv, HS, alpha=-1.0)  # in place, no n x n temporary: one matrix at a time
        W[:, S] = 0.0
        alive[S] = False
        left -= c
    keep = torch.nonzero(alive[:n]).flatten()
    return LayerPlan(keep.cpu().numpy(), W[:, keep].float().cpu().numpy(),
                     W[:, n].float().cpu().numpy() if fit_bias else None)


def obs_select(down: np.ndarray, st: LayerStats, k: int, bias: np.ndarray | None, fit_bias: bool,
               damp: float = 0.01, chunk: int | None = None, device: str = "cpu", consume: bool = False) -> LayerPlan:
    """One-shot structured OBS on the unpruned model's statistics (method "obs"), on `device`;
    `consume`: the caller gives `st.gram` away (it becomes None; one n x n matrix fewer)."""
    import torch

    n = down.shape[1]
    chunk = chunk or 8
    G = torch.as_tensor(st.gram).to(device=device, dtype=torch.float64)
    W = torch.from_numpy(np.ascontiguousarray(down)).to(device=device, dtype=torch.float64).clone()
    if fit_bias:  # constant feature 1: its Gram row is sum h, its diagonal the token count
        weighted = st.gram_sum is not None
        s = torch.from_numpy(st.gram_sum if weighted else st.sum).to(device=device, dtype=torch.float64)
        cnt = torch.tensor([float(st.gram_count if weighted else st.count)], dtype=torch.float64, device=device)
        G = torch.cat([torch.cat([G, s[:, None]], 1), torch.cat([s, cnt])[None]], 0)
        b0 = (torch.zeros(down.shape[0], dtype=torch.float64, device=device) if bias is None
              else torch.from_numpy(bias).to(device=device, dtype=torch.float64))
        W = torch.cat([W, b0[:, None]], 1)
    elif not consume:
        G = G.clone()  # damped below in place: the caller's statistics stay as they were
    if consume:
        st.gram = None  # given away: G is the caller's matrix, or holds all it said
    G.diagonal().add_(damp * float(G.diagonal()[:n].mean()))
    # The inverse through the Cholesky factor: two n x n float64 matrices at a time (the factor, then
    # the inverse) where a general inverse holds four (the matrix, its LU factors, the identity it
    # solves for, the result). A matrix that is not numerically positive definite takes the latter.
    L, info = torch.linalg.cholesky_ex(G)
    if int(info) == 0:
        del G
        Hinv = torch.cholesky_inverse(L)
    else:
        Hinv = torch.linalg.inv(G)
        del G
    del L
    return obs_prune(W, Hinv, n, k, fit_bias, chunk)


def plan_layer(method: str, gate: np.ndarray | None, up: np.ndarray, down: np.ndarray, bias: np.ndarray | None,
               st: LayerStats | None, k: int, rng: np.random.Generator, bias_ok: bool, device: str = "cpu",
               chunk: int | None = None, consume: bool = False) -> LayerPlan:
    """`gate` is None for an FFN without one (down(act(up x))); magnitude then scores ||up_i||.
    `consume`: obs may take `st.gram` over (see obs_select)."""
    n = down.shape[1]
    if k >= n:
        return LayerPlan(np.arange(n), None, None)
    if method == "obs":
        return obs_select(down, st, k, bias, fit_bias=bias_ok, device=device, chunk=chunk, consume=consume)
    if method == "a3b":
        raise ValueError("method a3b is sequential: use sequential.sequential_plans")
    keep = top(scores(method, gate, up, down, st, rng), k)
    if method == "flap" and bias_ok:
        pruned = np.setdiff1d(np.arange(n), keep)
        comp = down[:, pruned].astype(np.float64) @ st.mean[pruned]
        new_bias = (bias if bias is not None else 0.0) + comp
        return LayerPlan(keep, None, np.asarray(new_bias, dtype=np.float32))
    return LayerPlan(keep, None, None)
