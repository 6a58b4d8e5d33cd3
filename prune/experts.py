"""Mixture-of-experts pruning of qwen3moe and qwen35moe GGUFs: whole experts, and neurons inside experts.

Models such as Qwen3-30B-A3B route every token to a few (8) of many (128) experts per layer. Their
size, not their speed, keeps them off small GPUs, so removing whole experts is what pays. Experts are
ranked per layer on calibration text run through the GGUF as llama.cpp loads it (llama_stats.py):

- reap:      the mean, over the calibration tokens routed to the expert, of the router weight that
             scales its output times the norm of that output (REAP, router-weighted expert activation
             pruning); an expert never routed to scores 0.
- frequency: how many calibration tokens were routed to the expert.
- random:    a seeded random ranking (the floor the others must beat).

The same number of experts is kept in every layer (llama.cpp reads one `<arch>.expert_count` for all
layers). The router keeps its top-k over the remaining experts; the number routed per token
(`<arch>.expert_used_count`) is kept, and a ratio that would leave fewer experts than that is refused.
Both architectures renormalise the weights of the chosen experts to sum to one, so experts that
never win can go without changing any token's output.

`keep` < 1 also narrows every kept expert to one FFN width (`<arch>.expert_feed_forward_length`),
each expert choosing its own neurons from its routed tokens: random, magnitude, wanda (norm of the
down column x RMS of the neuron's activation), flap (variance x squared column norm, selection only:
experts carry no bias), and obs / a3b as the router-weighted wanda (the activation scaled by the
router weight, as in REAP). A shared expert (`*_shexp`, qwen35moe) is a dense FFN seen by every
token and is narrowed by the dense methods (obs / a3b as wanda; its least-squares re-fit is not done
here).

Streamed as the dense path (stream.py): one tensor in memory at a time. Removing experts slices the
stored bytes of the expert tensors and of the router rows (`ffn_gate_inp`), so quantised tensors keep
their bytes; narrowed experts keep their gate/up rows as stored bytes and requantise their down
projection per expert with llama.cpp's quantiser in its own type (or llama-quantize's fallback type
when the width does not fill its blocks), with the calibration's importance matrix.
"""
from __future__ import annotations

import hashlib
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.errors import UnsupportedArchitecture
from . import stream
from .calibrate import LayerStats, save_npz_atomic
from .config import PruneConfig, default_cache_dir
from .errors import InvalidRequest
from .layout import MOE_MARKERS, layer_of
from .llama_stats import FFNInputProbe, Probe
from .methods import DATA_FREE, width_for
from .source import SourceModel

#: Checked against llama.cpp's model code and tested with tiny files of each.
MOE_ARCHITECTURES = ("qwen3moe", "qwen35moe")
STATS_VERSION = 1

ROUTER = "ffn_gate_inp.weight"
#: Per-layer tensors whose first (numpy) axis runs over the routed experts.
GATE_UP_EXPS = ("ffn_gate_exps.weight", "ffn_up_exps.weight")
FUSED_EXPS = "ffn_gate_up_exps.weight"   # gate rows then up rows of each expert, in one tensor
DOWN_EXPS = "ffn_down_exps.weight"
EXPERT_TENSORS = (*GATE_UP_EXPS, FUSED_EXPS, DOWN_EXPS)
SHARED_ROWS = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight")
SHARED_DOWN = "ffn_down_shexp.weight"
SHARED_GATE = "ffn_gate_inp_shexp.weight"   # the shared expert's sigmoid gate: one value per token
KNOWN = {ROUTER, *EXPERT_TENSORS, *SHARED_ROWS, SHARED_DOWN, SHARED_GATE}

_DOWN_EXPS = re.compile(r"blk\.(\d+)\.ffn_down_exps\.weight")
_WEIGHTED = re.compile(r"ffn_moe_weighted-(\d+)")


def is_moe(tensor_names) -> bool:
    return any(layer_of(n) is not None and any(m in n for m in MOE_MARKERS) for n in tensor_names)


@dataclass(frozen=True)
class MoELayout:
    arch: str
    n_layer: int
    n_embd: int
    n_expert: int
    n_expert_used: int | list[int]       # one value, or one per layer
    n_ff_exp: int
    n_ff_shexp: int | None               # the shared expert's width; None without one
    fused: bool                          # gate and up stored together (ffn_gate_up_exps)

    @property
    def used_max(self) -> int:
        u = self.n_expert_used
        return max(u) if isinstance(u, list) else int(u)


def _widths(v, what: str, file_name: str, arch: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, list):
        ws = sorted({int(x) for x in v})
        if len(ws) != 1:
            raise UnsupportedArchitecture(
                f"{file_name} has {what} that differ per layer ({', '.join(map(str, ws[:6]))}); llama.cpp builds "
                f"{arch} experts from one width, so this file cannot be pruned to a uniform expert width here.")
        return ws[0]
    return int(v)


def check_moe_layout(src: SourceModel) -> MoELayout:
    """The expert layout of `src`, or UnsupportedArchitecture / InvalidRequest saying what is wrong."""
    arch, name = src.info.architecture, src.path.name
    names = list(src.tensors)
    if not is_moe(names):
        raise InvalidRequest(
            f"{name} is a dense model ({arch}): it has no routed experts, so --experts-keep has nothing to remove. "
            "Use --keep to remove FFN neurons instead.")
    if arch not in MOE_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"{name} is a mixture-of-experts model of architecture {arch!r}; expert pruning is checked for "
            f"{', '.join(MOE_ARCHITECTURES)} (which tensors carry the experts, how the router weights them). "
            "Pick a model of one of those.")
    if not src.meta(f"{arch}.expert_count"):
        raise UnsupportedArchitecture(f"{name} has expert tensors but no {arch}.expert_count: nothing says how many "
                                      "experts each layer has.")
    n_layer = src.hp.n_layer
    n_expert = int(src.meta(f"{arch}.expert_count"))
    used = src.meta(f"{arch}.expert_used_count")
    if used is None:
        raise UnsupportedArchitecture(f"{name} has no {arch}.expert_used_count: nothing says how many experts "
                                      "each token is routed to.")
    used = [int(x) for x in used] if isinstance(used, list) else int(used)
    if int(src.meta(f"{arch}.expert_group_count", 0) or 0) > 1:
        raise UnsupportedArchitecture(f"{name} routes experts in groups ({arch}.expert_group_count); removing "
                                      "experts would break the groups, which is not supported.")
    if int(src.meta(f"{arch}.nextn_predict_layers", 0) or 0) > 0:
        raise UnsupportedArchitecture(
            f"{name} has multi-token-prediction layers ({arch}.nextn_predict_layers) whose experts calibration does "
            "not reach; convert the model without them to prune its experts.")
    shapes = {n: stream.source_shape(src, n) for n in names}
    ffe = _widths(src.meta(f"{arch}.expert_feed_forward_length"), "expert FFN widths", name, arch)
    if ffe is None:
        ffe = shapes.get(f"blk.0.{DOWN_EXPS}", (0, 0, 0))[-1]
    ffs = _widths(src.meta(f"{arch}.expert_shared_feed_forward_length"), "shared expert FFN widths", name, arch)
    fused = f"blk.0.{FUSED_EXPS}" in shapes
    n_embd = src.hp.n_embd
    shared = any(n.endswith(SHARED_DOWN) for n in names)
    if not shared:
        ffs = None  # a width key without shared-expert tensors: nothing to narrow
    elif ffs is None:
        ffs = shapes[f"blk.0.{SHARED_DOWN}"][-1]
    for n in names:
        il = layer_of(n)
        if il is None:
            continue
        part = n.split(".", 2)[2]
        if part.startswith("ffn_") and "norm" not in part and part not in KNOWN or "exp_probs" in part:
            raise UnsupportedArchitecture(f"{name} has {n}, an FFN tensor expert pruning does not know how to "
                                          "slice; it handles the router, the routed and the shared experts.")
    for i in range(n_layer):
        p = f"blk.{i}."
        want = {ROUTER: (n_expert, n_embd), DOWN_EXPS: (n_expert, n_embd, ffe)}
        if fused:
            want[FUSED_EXPS] = (n_expert, 2 * ffe, n_embd)
        else:
            want.update({t: (n_expert, ffe, n_embd) for t in GATE_UP_EXPS})
        if shared:
            want.update({t: (ffs, n_embd) for t in SHARED_ROWS})
            want[SHARED_DOWN] = (n_embd, ffs)
        for part, shape in want.items():
            got = shapes.get(p + part)
            if got is None:
                raise UnsupportedArchitecture(f"{name} has no {p}{part}: every layer needs its router and experts.")
            if got != shape:
                what = ("experts of differing widths" if part in EXPERT_TENSORS and len(got) == 3
                        and got[0] == n_expert else "a shape the metadata does not describe")
                raise UnsupportedArchitecture(f"{name}: {p}{part} has shape {got}, expected {shape} ({what}); "
                                              "expert pruning needs one expert count and one expert width.")
    return MoELayout(arch, n_layer, n_embd, n_expert, used, ffe, ffs, fused)


# -- statistics -------------------------------------------------------------------------------------------
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


# -- plans --------------------------------------------------------------------------------------------
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


def top(score: np.ndarray, k: int) -> np.ndarray:
    """The indices of the `k` highest scores, in ascending order (ties: the lower index)."""
    return np.sort(np.argsort(-np.asarray(score), kind="stable")[:k])


def n_experts_kept(cfg: PruneConfig, lay: MoELayout, file_name: str) -> int:
    n = max(1, int(round(cfg.experts_keep * lay.n_expert)))
    if n < lay.used_max:
        raise InvalidRequest(
            f"--experts-keep {cfg.experts_keep:g} keeps {n} of the {lay.n_expert} experts of every layer of "
            f"{file_name}, fewer than the {lay.used_max} llama.cpp routes every token to "
            f"({lay.arch}.expert_used_count); use at least {math.ceil(lay.used_max / lay.n_expert * 1000) / 1000:g}.")
    return n


def _dequant(data: np.ndarray, qtype: int) -> np.ndarray:
    """Stored values of one expert (or any tensor slice) -> float32 (rows, n)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if qtype == 0:
        return np.asarray(data, dtype=np.float32)
    return dequantize(np.asarray(data), GGMLQuantizationType(qtype)).astype(np.float32, copy=False)


def _norms(src: SourceModel, name: str, e: int, axis: int) -> np.ndarray:
    """Norms of expert `e`'s columns (axis 0) or rows (axis 1) in tensor `name`."""
    return np.linalg.norm(_dequant(stream.stored(src, name)[e], stream.source_type(src, name)), axis=axis)


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


NEURON_SELECTION = {"obs": "router-weighted-wanda", "a3b": "router-weighted-wanda"}


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
    from .methods import plan_layer

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
            method = cfg.method if cfg.method in ("random", "magnitude", "wanda", "flap") else "wanda"
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


# -- writing ------------------------------------------------------------------------------------------
def expert_tensors(src: SourceModel, lay: MoELayout, pl: MoEPlan, k: int,
                   k_shared: int | None) -> list[stream.OutTensor]:
    """Every output tensor, made when written (one in memory at a time)."""
    from .streamed import down_type

    out = []
    for name in src.tensors:
        il = layer_of(name)
        part = name.split(".", 2)[2] if il is not None else ""
        qt, shape = stream.source_type(src, name), stream.source_shape(src, name)
        experts = pl.experts.get(il) if il is not None else None
        narrow = il in pl.neurons
        if experts is None or part not in KNOWN or part == SHARED_GATE:
            out.append(stream.copy_tensor(src, name))
        elif part == ROUTER or part in EXPERT_TENSORS and not narrow:
            out.append(stream.copy_tensor(src, name) if len(experts) == lay.n_expert
                       else stream.rows_tensor(src, name, experts))
        elif part in GATE_UP_EXPS or part == FUSED_EXPS:
            rows = pl.neurons[il]
            if part == FUSED_EXPS:
                rows = np.concatenate([rows, rows + lay.n_ff_exp], axis=1)

            def make(name=name, experts=experts, rows=rows):
                data = stream.stored(src, name)
                return np.stack([np.asarray(data[e])[r] for e, r in zip(experts, rows)])
            out.append(stream.OutTensor(name, qt, (len(experts), rows.shape[1], shape[-1]), make))
        elif part == DOWN_EXPS:
            dqt = down_type(qt, k)

            def make(name=name, il=il, experts=experts, qt=qt, dqt=dqt):
                data = stream.stored(src, name)
                return np.stack([stream.encode(np.take(_dequant(data[e], qt), r, axis=1), dqt, im)
                                 for e, r, im in zip(experts, pl.neurons[il], pl.imatrix[il])])
            out.append(stream.OutTensor(name, dqt, (len(experts), shape[1], k), make))
        elif il not in pl.shared:
            out.append(stream.copy_tensor(src, name))
        elif part in SHARED_ROWS:
            out.append(stream.rows_tensor(src, name, pl.shared[il]))
        else:  # the shared expert's down projection
            dqt = down_type(qt, k_shared)
            out.append(stream.value_tensor(name, dqt, (shape[0], k_shared),
                                           lambda name=name, il=il: np.take(src.weight(name), pl.shared[il], axis=1),
                                           lambda il=il: pl.shared_imatrix[il]))
    return out


def _used(lay: MoELayout, n_keep: int) -> int | list[int]:
    u = lay.n_expert_used
    return [min(x, n_keep) for x in u] if isinstance(u, list) else min(u, n_keep)


def write_pruned(src: SourceModel, lay: MoELayout, pl: MoEPlan, out: str | Path, k: int, k_shared: int | None,
                 meta: dict[str, Any], *, progress: bool = False, should_stop=None) -> None:
    """Write `src` pruned as `pl` says to `out` (complete or not at all): the expert count, experts used
    per token (capped at the new count) and expert widths written once, `meta` as a3b.* keys."""
    from .writer import atomic_path

    n_keep = len(pl.experts[0])
    tensors = expert_tensors(src, lay, pl, k, k_shared)
    stream.check_disk(Path(out), stream.output_bytes(tensors))
    arch = lay.arch
    kv: dict[str, Any] = {f"{arch}.expert_count": n_keep, f"{arch}.expert_used_count": _used(lay, n_keep),
                          f"{arch}.expert_feed_forward_length": k}
    if k_shared is not None:
        kv[f"{arch}.expert_shared_feed_forward_length"] = k_shared
    meta = {**meta, "requant.fallback_tensors": sum(
        1 for x in tensors if x.name.endswith((DOWN_EXPS, SHARED_DOWN)) and x.qtype != stream.source_type(src, x.name))}
    with atomic_path(out, force=True) as tmp:
        stream.write(src, tmp, tensors, n_ff=None, a3b=meta, kv=kv, progress=progress, should_stop=should_stop)


# -- the whole run ------------------------------------------------------------------------------------
def _stats_key(src_sha: str, tokens: np.ndarray, neurons: bool, shared: bool) -> str:
    h = hashlib.sha256(f"moe-v{STATS_VERSION}:{src_sha}:{int(neurons)}:{int(shared)}:".encode() + tokens.tobytes())
    return h.hexdigest()[:24]


def collect(src: SourceModel, lay: MoELayout, wins: list[list[int]], cfg: PruneConfig, *, neurons: bool,
            shared: bool, cache: Path, progress: bool, should_stop=None) -> tuple[ExpertStats, bool]:
    """One pass of llama.cpp over the calibration windows (cached on disk); (statistics, whether cached)."""
    from tqdm import tqdm

    from .llama_stats import LlamaCalibrator

    tokens = np.array(wins, dtype=np.int32)
    path = cache / "moe-stats" / f"{_stats_key(src.sha256, tokens, neurons, shared)}.npz"
    if path.is_file():
        try:
            with np.load(path) as z:
                return ExpertStats.from_arrays({k: z[k] for k in z.files}), True
        except (OSError, KeyError, ValueError):
            pass
    probe = ExpertProbe(lay.n_layer, lay.n_expert, neurons=neurons)
    probes: list[Probe] = [probe]
    sprobe = SharedExpertProbe(lay.n_layer) if shared else None
    if sprobe is not None:
        probes.append(sprobe)
    bar = tqdm(total=len(wins), desc="calibrating (llama.cpp, experts)", unit="seq", disable=not progress)
    try:
        with LlamaCalibrator(src.path, n_ctx=cfg.seq_len, n_gpu_layers=cfg.n_gpu_layers,
                             n_threads=cfg.threads) as cal:
            cal.run(probes, wins, progress=bar.update, should_stop=should_stop)
    finally:
        bar.close()
    st = probe.stats()
    if not st.count.sum():
        raise RuntimeError("calibration saw no routed expert: llama.cpp's graph has no ffn_down_exps product or "
                           "ffn_moe_weighted node here (a llama.cpp version whose graph names differ)")
    if sprobe is not None:
        st.shared = {il: sprobe.layer_stats(il) for il in sprobe.acc}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_npz_atomic(path, st.arrays())
    return st, False


def _align(src: SourceModel, lay: MoELayout, part: str) -> int:
    from . import ggml

    a = 1
    for i in range(lay.n_layer):
        a = math.lcm(a, ggml.block_size(stream.source_type(src, f"blk.{i}.{part}")))
    return a


def prune_moe(source, out, cfg: PruneConfig, *, progress: bool = True, cache_dir=None, should_stop=None):
    """Prune the experts (and expert neurons) of `source` into `out`. Returns a pipeline.PruneResult."""
    from .pipeline import PruneResult
    from .streamed import require_llama_runs, source_windows

    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    src = SourceModel(source, torch_reference=False)
    lay = check_moe_layout(src)
    require_llama_runs(src)
    if cfg.heads_keep < 1.0:
        raise InvalidRequest("head pruning runs on the torch reference forward, which has no mixture-of-experts "
                             "architecture; use --heads-keep 1 with expert pruning.")
    if cfg.recover_steps > 0 and (cfg.keep < 1.0 or cfg.experts_keep < 1.0):
        raise InvalidRequest("recovery by distillation runs on the torch reference forward, which has no "
                             "mixture-of-experts architecture: expert pruning is one-shot. Pass --recover-steps 0.")
    n_keep = n_experts_kept(cfg, lay, src.path.name)
    align = cfg.align if cfg.align is not None else _align(src, lay, DOWN_EXPS)
    k = width_for(cfg.keep, lay.n_ff_exp, align)
    k_shared = None
    if lay.n_ff_shexp is not None:
        sa = cfg.align if cfg.align is not None else _align(src, lay, SHARED_DOWN)
        k_shared = width_for(cfg.keep, lay.n_ff_shexp, sa)
    narrow = k < lay.n_ff_exp
    narrow_shared = k_shared is not None and k_shared < lay.n_ff_shexp
    data_methods = cfg.method not in DATA_FREE
    needs_stats = (n_keep < lay.n_expert and cfg.expert_method != "random") or \
        ((narrow or narrow_shared) and data_methods)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = Path(out)
    corpus_info: dict[str, Any] = {}
    st, cached = None, False
    timings["load"] = time.perf_counter() - t0
    t = time.perf_counter()
    if needs_stats:
        wins, corpus_info, cfg = source_windows(src, cfg)
        st, cached = collect(src, lay, wins, cfg, neurons=narrow and data_methods,
                             shared=narrow_shared and data_methods, cache=cache, progress=progress,
                             should_stop=should_stop)
    timings["calibrate"] = time.perf_counter() - t
    t = time.perf_counter()
    pl = plan(src, lay, cfg, st, n_keep, k, k_shared)
    timings["plan"] = time.perf_counter() - t

    t = time.perf_counter()
    used = lay.n_expert_used
    new_used = _used(lay, n_keep)
    meta: dict[str, Any] = {
        "kind": "moe", "experts.method": cfg.expert_method if n_keep < lay.n_expert else "none",
        "experts.keep": float(cfg.experts_keep), "experts.keep_actual": n_keep / lay.n_expert,
        "n_expert": n_keep, "n_expert_source": lay.n_expert,
        "n_expert_used": new_used, "n_expert_used_source": used,
        "method": cfg.method, "selection": NEURON_SELECTION.get(cfg.method, cfg.method) if narrow else "none",
        "keep": float(cfg.keep), "keep_actual": k / lay.n_ff_exp, "n_ff_exp": k, "n_ff_exp_source": lay.n_ff_exp,
        "align": int(align), "heads_keep": 1.0, "n_head": src.hp.n_head, "n_head_source": src.hp.n_head,
        "source.sha256": src.sha256, "source.name": src.path.name,
        "source.file_type": int(src.hp.file_type) if src.hp.file_type is not None else 0,
        "calib.engine": "llama.cpp" if needs_stats else "none", "calib.n_gpu_layers": int(cfg.n_gpu_layers),
        "recover.steps": 0, "recover.kind": "none",
        "recover.final_kl": 0.0, "seed": int(cfg.seed), "config": cfg.key(), **corpus_info,
    }
    if k_shared is not None:
        meta.update({"n_ff_shexp": k_shared, "n_ff_shexp_source": lay.n_ff_shexp,
                     "shexp.selection": (cfg.method if cfg.method in ("random", "magnitude", "wanda", "flap")
                                         else "wanda") if narrow_shared else "none"})
    if n_keep < lay.n_expert:
        for il in range(lay.n_layer):
            meta[f"experts.removed.{il}"] = [int(e) for e in np.setdiff1d(np.arange(lay.n_expert), pl.experts[il])]
    write_pruned(src, lay, pl, out, k, k_shared, meta, progress=progress, should_stop=should_stop)
    timings["write"] = time.perf_counter() - t
    meta["calib.cached"] = cached
    return PruneResult(out, lay.n_ff_exp, k, meta, timings, [])
