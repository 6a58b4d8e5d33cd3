"""Which experts, expert neurons and shared-expert neurons stay in every layer (see the package docstring)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..config import PruneConfig
from ..dense.methods import plan_layer, top
from ..errors import InvalidRequest
from ..source import SourceModel
from .layout import DOWN_EXPS, FUSED_EXPS, GATE_UP_EXPS, SHARED_DOWN, SHARED_ROWS, MoELayout
from .stats import ExpertStats

#: what obs and a3b mean for expert neurons (the least-squares re-fit is not done here)
NEURON_SELECTION = {"obs": "router-weighted-wanda", "a3b": "router-weighted-wanda"}
#: the dense methods a shared expert is narrowed by (others: wanda)
SHARED_METHODS = ("random", "magnitude", "wanda", "flap")


def expert_scores(method: str, st: ExpertStats | None, il: int, n_expert: int, seed: int) -> np.ndarray:
    """One score per expert of layer `il`; the highest stay."""
    if method == "random":
        return np.random.default_rng([seed, il, 1]).random(n_expert)
    if st is None:
        raise ValueError(f"expert ranking {method!r} needs calibration statistics")
    if method == "frequency":
        return st.count[il].astype(np.float64)
    if method == "reap":
        c = st.count[il]
        return np.divide(st.reap[il], c, out=np.zeros(n_expert), where=c > 0)
    raise ValueError(f"unknown expert ranking {method!r}")


def n_experts_kept(cfg: PruneConfig, lay: MoELayout, file_name: str) -> int:
    n = max(1, int(round(cfg.experts_keep * lay.n_expert)))
    if n < lay.used_max:
        raise InvalidRequest(
            f"--experts-keep {cfg.experts_keep:g} keeps {n} of the {lay.n_expert} experts of every layer of "
            f"{file_name}, fewer than the {lay.used_max} llama.cpp routes every token to "
            f"({lay.arch}.expert_used_count); use at least {math.ceil(lay.used_max / lay.n_expert * 1000) / 1000:g}.")
    return n


def dequant(data: np.ndarray, qtype: int) -> np.ndarray:
    """Stored values of one expert (or any tensor slice) -> float32 (rows, n)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if qtype == 0:
        return np.asarray(data, dtype=np.float32)
    return dequantize(np.asarray(data), GGMLQuantizationType(qtype)).astype(np.float32, copy=False)


def _norms(src: SourceModel, name: str, e: int, axis: int) -> np.ndarray:
    """Norms of expert `e`'s columns (axis 0) or rows (axis 1) in tensor `name`."""
    return np.linalg.norm(dequant(src.stored(name)[e], src.qtype(name)), axis=axis)


def neuron_scores(method: str, src: SourceModel, lay: MoELayout, st: ExpertStats | None, il: int, e: int,
                  seed: int) -> np.ndarray:
    """Scores of expert `e`'s neurons in layer `il` (see the module docstring)."""
    p = f"blk.{il}."
    F = lay.n_ff_exp
    if method == "random":
        return np.random.default_rng([seed, il, e, 2]).random(F)
    dn = _norms(src, p + DOWN_EXPS, e, 0)
    if method == "magnitude":
        if lay.fused:
            gu = _norms(src, p + FUSED_EXPS, e, 1)
            return gu[:F] * gu[F:] * dn
        g, u = (_norms(src, p + t, e, 1) for t in GATE_UP_EXPS)
        return g * u * dn
    n = max(float(st.count[il, e]), 1.0)
    if method == "wanda":
        return dn * np.sqrt(st.hsq[il, e])
    if method == "flap":
        mean = st.hsum[il, e] / n
        return np.maximum(st.hsq[il, e] / n - mean ** 2, 0.0) * dn ** 2
    return dn * np.sqrt(st.whsq[il, e])  # obs, a3b: router-weighted wanda


def shared_method(cfg: PruneConfig) -> str:
    return cfg.method if cfg.method in SHARED_METHODS else "wanda"


@dataclass
class MoEPlan:
    experts: dict[int, np.ndarray]                    # kept experts per layer (sorted)
    neurons: dict[int, np.ndarray] = field(default_factory=dict)   # (n_kept, k) per layer, when narrowed
    imatrix: dict[int, np.ndarray] = field(default_factory=dict)   # (n_kept, k) mean h^2 per layer
    shared: dict[int, np.ndarray] = field(default_factory=dict)    # kept shared-expert neurons per layer
    shared_imatrix: dict[int, np.ndarray] = field(default_factory=dict)


def plan(src: SourceModel, lay: MoELayout, cfg: PruneConfig, st: ExpertStats | None, n_keep: int, k: int,
         k_shared: int | None) -> MoEPlan:
    """Which experts, expert neurons and shared-expert neurons stay in every layer."""
    pl = MoEPlan({})
    for il in range(lay.n_layer):
        if n_keep < lay.n_expert:
            pl.experts[il] = top(expert_scores(cfg.expert_method, st, il, lay.n_expert, cfg.seed), n_keep)
        else:
            pl.experts[il] = np.arange(lay.n_expert)
        if k < lay.n_ff_exp:
            rows, ims = [], []
            for e in pl.experts[il]:
                keep = top(neuron_scores(cfg.method, src, lay, st, il, int(e), cfg.seed), k)
                rows.append(keep)
                c = st.count[il, e] if st is not None and st.hsq is not None else 0
                ims.append(st.hsq[il, e, keep] / c if c else np.ones(k))
            pl.neurons[il] = np.array(rows, dtype=np.int64)
            pl.imatrix[il] = np.array(ims, dtype=np.float32)
        if k_shared is not None and k_shared < lay.n_ff_shexp:
            p = f"blk.{il}."
            method = shared_method(cfg)
            sst = st.shared.get(il) if st is not None else None
            down = src.weight(p + SHARED_DOWN)
            gate = up = None
            if method == "magnitude":
                gate, up = src.weight(p + SHARED_ROWS[0]), src.weight(p + SHARED_ROWS[1])
            lp = plan_layer(method, gate, up, down, None, sst, k_shared, np.random.default_rng([cfg.seed, il, 3]),
                            False)
            keep = np.asarray(lp.keep, dtype=np.int64)
            pl.shared[il] = keep
            pl.shared_imatrix[il] = (sst.sumsq[keep] / sst.count).astype(np.float32) if sst is not None and sst.count \
                else np.ones(k_shared, np.float32)
    return pl
