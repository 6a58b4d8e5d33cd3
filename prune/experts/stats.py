"""Routing statistics of a mixture-of-experts model, from llama.cpp's graph evaluation (calibration/llama_stats.py).

Per layer and expert: the tokens routed to it, the sum of its router weight times its output's
norm (REAP), the sum of its router weights; per expert neuron, where experts are narrowed, the sums
of its activation h, h^2 and (router weight x h)^2 over its routed tokens; the shared expert's
dense statistics. Gathered in one pass over the calibration windows and cached on disk.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..calibration.llama_stats import FFNInputProbe, Probe, observe
from ..calibration.stats import LayerStats
from ..config import PruneConfig
from ..files import load_npz, save_npz_atomic
from ..source import SourceModel
from .layout import MoELayout

STATS_VERSION = 1

_DOWN_EXPS = re.compile(r"blk\.(\d+)\.ffn_down_exps\.weight")
_WEIGHTED = re.compile(r"ffn_moe_weighted-(\d+)")


@dataclass
class ExpertStats:
    """Per layer and expert (arrays (n_layer, n_expert)): tokens routed, sum of router weight x output
    norm, sum of router weights; per expert neuron (n_layer, n_expert, n_ff_exp), when gathered: sums of
    h, h^2 and (w h)^2 over the routed tokens; shared-expert LayerStats per layer."""
    count: np.ndarray
    reap: np.ndarray
    weight: np.ndarray
    hsum: np.ndarray | None = None
    hsq: np.ndarray | None = None
    whsq: np.ndarray | None = None
    shared: dict[int, LayerStats] = field(default_factory=dict)

    def arrays(self) -> dict[str, np.ndarray]:
        out = {k: getattr(self, k) for k in ("count", "reap", "weight", "hsum", "hsq", "whsq")
               if getattr(self, k) is not None}
        for il, st in self.shared.items():
            out.update({f"sh{il}_count": np.array(st.count), f"sh{il}_sum": st.sum, f"sh{il}_sumsq": st.sumsq,
                        f"sh{il}_sumabs": st.sumabs})
        return out

    @classmethod
    def from_arrays(cls, z) -> ExpertStats:
        s = cls(z["count"], z["reap"], z["weight"], *(z[k] if k in z else None for k in ("hsum", "hsq", "whsq")))
        for k in z:
            if k.startswith("sh") and k.endswith("_count"):
                il = int(k[2:].split("_")[0])
                s.shared[il] = LayerStats(int(z[k]), z[f"sh{il}_sum"], z[f"sh{il}_sumsq"], z[f"sh{il}_sumabs"], None)
        return s


class ExpertProbe(Probe):
    """Routing statistics from llama.cpp's MoE graph (build_moe_ffn).

    Two nodes per layer: the down projection of the chosen experts (MUL_MAT_ID over
    `blk.<i>.ffn_down_exps.weight`; its src[2] holds the chosen experts, src[1] their activations h,
    its output each expert's output y) and `ffn_moe_weighted-<i>`, which scales y by the router
    weights (src[1]: the weights after top-k renormalisation, the factor the output really gets).
    The first is held until the second arrives.
    """

    def __init__(self, n_layer: int, n_expert: int, neurons: bool = False):
        self.n_expert = n_expert
        self.neurons = neurons
        self.count = np.zeros((n_layer, n_expert))
        self.reap = np.zeros((n_layer, n_expert))
        self.weight = np.zeros((n_layer, n_expert))
        self.hsum = self.hsq = self.whsq = None
        self._pending: dict[int, tuple] = {}

    def match(self, node):
        if node.op == "MUL_MAT_ID":
            w = node.src(0)
            m = _DOWN_EXPS.fullmatch(w.name) if w is not None else None
            return ("down", int(m.group(1))) if m else None
        if node.op == "MUL":
            m = _WEIGHTED.fullmatch(node.name)
            return ("weighted", int(m.group(1))) if m else None
        return None

    def record(self, key, node):
        kind, il = key
        if kind == "down":
            ids = node.src(2).numpy()
            ids = ids.reshape(-1, ids.shape[-1])                       # (tokens, used)
            y = node.numpy().reshape(*ids.shape, -1)                   # (tokens, used, n_embd)
            h = node.src(1).numpy().reshape(*ids.shape, -1) if self.neurons else None
            self._pending[il] = (ids, np.linalg.norm(y.astype(np.float64), axis=-1), h)
            return
        pending = self._pending.pop(il, None)
        if pending is None:
            return
        ids, norms, h = pending
        w = node.src(1).numpy().astype(np.float64).reshape(ids.shape)
        flat = ids.ravel()
        E = self.n_expert
        self.count[il] += np.bincount(flat, minlength=E)
        self.reap[il] += np.bincount(flat, weights=(w * norms).ravel(), minlength=E)
        self.weight[il] += np.bincount(flat, weights=w.ravel(), minlength=E)
        if h is not None:
            hh = h.reshape(len(flat), -1).astype(np.float64)
            if self.hsq is None:
                shape = (self.count.shape[0], E, hh.shape[1])
                self.hsum, self.hsq, self.whsq = np.zeros(shape), np.zeros(shape), np.zeros(shape)
            onehot = np.zeros((E, len(flat)))
            onehot[flat, np.arange(len(flat))] = 1.0
            sq = hh * hh
            self.hsum[il] += onehot @ hh
            self.hsq[il] += onehot @ sq
            self.whsq[il] += onehot @ (sq * (w.ravel() ** 2)[:, None])

    def stats(self) -> ExpertStats:
        return ExpertStats(self.count, self.reap, self.weight, self.hsum, self.hsq, self.whsq)


class SharedExpertProbe(FFNInputProbe):
    """The shared expert's down-projection input, per layer (a dense FFN's statistics)."""

    weight_pattern = re.compile(r"^blk\.(\d+)\.ffn_down_shexp\.weight$")


def _stats_key(src_sha: str, tokens: np.ndarray, neurons: bool, shared: bool) -> str:
    h = hashlib.sha256(f"moe-v{STATS_VERSION}:{src_sha}:{int(neurons)}:{int(shared)}:".encode() + tokens.tobytes())
    return h.hexdigest()[:24]


def collect(src: SourceModel, lay: MoELayout, wins: list[list[int]], cfg: PruneConfig, *, neurons: bool,
            shared: bool, cache: Path, progress: bool, should_stop=None) -> tuple[ExpertStats, bool]:
    """One pass of llama.cpp over the calibration windows (cached on disk); (statistics, whether cached)."""
    tokens = np.array(wins, dtype=np.int32)
    path = cache / "moe-stats" / f"{_stats_key(src.sha256, tokens, neurons, shared)}.npz"
    z = load_npz(path) if path.is_file() else None
    if z is not None:
        try:
            return ExpertStats.from_arrays(z), True
        except KeyError:
            pass  # damaged: gathered again
    probe = ExpertProbe(lay.n_layer, lay.n_expert, neurons=neurons)
    probes: list[Probe] = [probe]
    sprobe = SharedExpertProbe(lay.n_layer) if shared else None
    if sprobe is not None:
        probes.append(sprobe)
    observe(src, probes, wins, cfg, "calibrating (llama.cpp, experts)", progress=progress, should_stop=should_stop)
    st = probe.stats()
    if not st.count.sum():
        raise RuntimeError("calibration saw no routed expert: llama.cpp's graph has no ffn_down_exps product or "
                           "ffn_moe_weighted node here (a llama.cpp version whose graph names differ)")
    if sprobe is not None:
        st.shared = {il: sprobe.layer_stats(il) for il in sprobe.acc}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_npz_atomic(path, st.arrays())
    return st, False
