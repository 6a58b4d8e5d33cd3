"""Calibration statistics from llama.cpp's own graph evaluation (any architecture it runs; no torch).

llama.cpp runs the GGUF as it loads it (quantised, on the CPU or with layers offloaded to a GPU) and
hands the graph's nodes to observers (runtime/llama/graph.py, the mechanism of llama.cpp's imatrix
tool). Here a set of `Probe`s, those observers, decides which nodes to observe and what to
accumulate.

`FFNInputProbe` records, per layer, the input of the FFN down projection (the matrix product whose
weight is `blk.<i>.ffn_down.weight`): the FFN's intermediate activations h = act(gate x) * up x in
every architecture with a gate/up/down FFN. It accumulates the token count, sum h, sum h^2, sum |h|
and, for the layers that need a least-squares refit, the Gram matrix H^T H (token-weighted for
models that normalise the FFN output, see `FFNInputProbe`). Gram matrices are
n_ff x n_ff per layer (1.2 GB in float64 at n_ff 12288), so they are collected for a group of
layers per pass (`gram_budget`), and a pass stops llama.cpp right after the last layer it needs.

Other statistics (mixture-of-experts router probabilities, chosen experts, per-expert inputs) plug
in the same way: a `Probe`'s `match` sees every node with its operation, name and sources (a
MUL_MAT_ID node's src[2] holds the chosen experts), `record` gets the computed node; `PatternProbe`
does this for nodes chosen by a regular expression over weight or node names. Several probes can
observe one pass (`LlamaCalibrator.run([probe_a, probe_b], windows)`).
"""
from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...runtime.errors import UnsupportedArchitecture
from ...runtime.llama import llama_cpp_version
from ...runtime.llama.weights import probe_architecture
from ...runtime.llama.ggml import TensorView
from ...runtime.llama.graph import GraphEvaluator
from ..config import PruneConfig
from ..errors import require_torch
from ..source import SourceModel
from .stats import LayerStats

log = logging.getLogger("comfyui_a3b.prune")

_FFN_DOWN = re.compile(r"^blk\.(\d+)\.ffn_down\.weight$")


class Probe:
    """One kind of statistic gathered from llama.cpp's graph evaluation."""

    def match(self, node: TensorView) -> Hashable | None:
        """At ask time: a key if this node should be observed, else None. Must be cheap."""
        raise NotImplementedError

    def record(self, key: Hashable, node: TensorView) -> None:
        """The node `match` chose, computed."""
        raise NotImplementedError

    def last_key(self) -> Hashable | None:
        """The key after which nothing more is needed from the graph (None: run it to the end)."""
        return None


class PatternProbe(Probe):
    r"""Observe graph nodes chosen by a regular expression and hand each computed node to `on_node`.

    The pattern is matched (re.fullmatch) against the name of the weight a matrix product reads
    (`weight=True`, src[0]: `blk.12.ffn_down_exps.weight`, `blk.3.ffn_gate_inp.weight`) or against
    the node's own name (`weight=False`: llama.cpp names graph nodes `<what>-<layer>`, e.g.
    `ffn_moe_probs-12`, `ffn_out-3`; names differ between architectures and llama.cpp versions).
    `ops` restricts the operations (MUL_MAT, MUL_MAT_ID, SOFT_MAX, ...). The key handed to
    `on_node(key, node)` is the match's groups converted to int where they are digits (the layer),
    so `r"blk\.(\d+)\.ffn_gate_inp\.weight"` gives the layer number. `node.numpy()` reads the
    computed output, `node.src(1).numpy()` a matrix product's input, `node.src(2).numpy()` a
    MUL_MAT_ID's chosen experts (int32). `last` (a key) lets a pass stop after that node.
    """

    def __init__(self, pattern: str, on_node: Callable[[Hashable, TensorView], None], *,
                 ops: Iterable[str] | None = None, weight: bool = True, last: Hashable | None = None):
        self.pattern = re.compile(pattern)
        self.on_node = on_node
        self.ops = None if ops is None else frozenset(ops)
        self.weight = weight
        self.last = last

    def match(self, node):
        if self.ops is not None and node.op not in self.ops:
            return None
        if self.weight:
            w = node.src(0)
            name = w.name if w is not None else ""
        else:
            name = node.name
        m = self.pattern.fullmatch(name)
        if m is None:
            return None
        groups = tuple(int(g) if g is not None and g.isdigit() else g for g in m.groups())
        return groups[0] if len(groups) == 1 else (groups or name)

    def record(self, key, node):
        self.on_node(key, node)

    def last_key(self):
        return self.last


@dataclass
class _Acc:
    count: int = 0
    sum: np.ndarray | None = None
    sumsq: np.ndarray | None = None
    sumabs: np.ndarray | None = None
    gram: object = None  # numpy float64 or a torch float64 tensor on the chosen device
    wsum: np.ndarray | None = None  # weighted Gram only: sum w_t h_t and sum w_t (the bias feature's row)
    wcount: float = 0.0


class FFNInputProbe(Probe):
    """Per-layer statistics of the FFN down projection's input (see the module docstring).

    `layers`: the layers to observe (None: all); `gram_layers`: those whose Gram matrix is
    accumulated; `device`: where Gram matrices are accumulated ("cpu" with numpy, or a torch device).

    `weighted`: for models whose FFN output y = W_down h passes an RMSNorm before the residual add
    (Gemma's post_ffw_norm), the Gram matrix is sum_t w_t h_t h_t^T with w_t = 1 / (mean(y_t^2) + eps).
    After that norm a token's output error counts relative to its output's RMS, not in absolute
    size, so an unweighted least-squares fit spends its budget on the few tokens with large FFN
    outputs (on Gemma 3 270M at keep 0.8, width 1632: held-out perplexity ratio 1.24 plain, 1.09 weighted, on
    code). The sums (selection scores, the requantisation's importance matrix) stay unweighted.
    """

    #: The down projection whose input is observed (a subclass may watch another FFN's, e.g. a shared expert's).
    weight_pattern = _FFN_DOWN
    #: keeps the weight of a token whose FFN output is all but zero finite (Gemma's own RMSNorm epsilon)
    eps = 1e-6

    def __init__(self, n_layer: int, layers: Iterable[int] | None = None, gram_layers: Iterable[int] = (),
                 device: str = "cpu", weighted: bool = False, spill_dir: Path | None = None,
                 spill_layers: Iterable[int] = ()):
        self.n_layer = n_layer
        self.layers = set(range(n_layer)) if layers is None else set(layers)
        self.gram_layers = set(gram_layers)
        self.device = device
        self.weighted = weighted
        self.acc: dict[int, _Acc] = {}
        #: Gram layers whose inputs go to a file in `spill_dir` during the pass (float32 rows, and the
        #: token weights), their Gram matrix made from it when asked for (`take`): the same sums in
        #: the same order, so the same matrix, without holding every layer's at once
        self.spill_layers = set(spill_layers) & self.gram_layers
        self.spill_dir = spill_dir
        self._spill_rows: dict[int, list[int]] = {}
        self._torch = None
        if self.gram_layers and device != "cpu":
            self._torch = require_torch()

    def match(self, node):
        if node.op != "MUL_MAT":
            return None
        w = node.src(0)
        m = self.weight_pattern.match(w.name) if w is not None else None
        if m is None:
            return None
        il = int(m.group(1))
        return il if il in self.layers else None

    def last_key(self):
        return max(self.layers) if self.layers else None

    def token_weights(self, node: TensorView) -> np.ndarray:
        """w_t = 1 / (mean_c y_t^2 + eps), y the down projection's output (tokens x n_embd)."""
        y = node.numpy()
        y = y.reshape(-1, y.shape[-1]).astype(np.float64)
        return 1.0 / ((y * y).mean(1) + self.eps)

    def record(self, il, node):
        x = node.src(1).numpy()
        x = x.reshape(-1, x.shape[-1])           # (tokens, n_ff)
        a = self.acc.setdefault(il, _Acc())
        xd = x.astype(np.float64)
        if a.sum is None:
            n = x.shape[1]
            a.sum, a.sumsq, a.sumabs = np.zeros(n), np.zeros(n), np.zeros(n)
        a.count += x.shape[0]
        a.sum += xd.sum(0)
        a.sumsq += (xd * xd).sum(0)
        a.sumabs += np.abs(xd).sum(0)
        if il not in self.gram_layers:
            return
        w = None
        if self.weighted:
            w = self.token_weights(node)
            a.wsum = (w @ xd) + (0.0 if a.wsum is None else a.wsum)
            a.wcount += float(w.sum())
        if il in self.spill_layers:
            with open(self._spill_path(il, "x"), "ab") as f:
                np.ascontiguousarray(x, dtype=np.float32).tofile(f)
            if w is not None:
                with open(self._spill_path(il, "w"), "ab") as f:
                    w.tofile(f)
            self._spill_rows.setdefault(il, []).append(x.shape[0])
            return
        self._add_gram(a, x, xd, w)

    def _add_gram(self, a: _Acc, x: np.ndarray, xd: np.ndarray, w: np.ndarray | None) -> None:
        if self._torch is not None:
            t = self._torch
            if w is None:
                xt = t.from_numpy(x).to(self.device)
                g = (xt.T @ xt).double()
            else:
                xt = t.from_numpy(xd).to(self.device)  # float64 already
                g = (xt * t.from_numpy(w).to(self.device)[:, None]).T @ xt
        else:
            g = (x.T @ x).astype(np.float64) if w is None else (xd * w[:, None]).T @ xd
        if a.gram is None:
            a.gram = g
        else:
            a.gram += g

    def _spill_path(self, il: int, what: str) -> Path:
        return self.spill_dir / f"layer{il:04d}.{what}"

    def _unspill(self, il: int) -> None:
        """Make a spilled layer's Gram matrix from its file, window by window as `record` would have."""
        a = self.acc[il]
        xs, ws = self._spill_path(il, "x"), self._spill_path(il, "w")
        n = a.sum.shape[0]
        with open(xs, "rb") as fx, (open(ws, "rb") if self.weighted else contextlib.nullcontext()) as fw:
            for rows in self._spill_rows.pop(il, []):
                x = np.fromfile(fx, dtype=np.float32, count=rows * n).reshape(rows, n)
                w = np.fromfile(fw, dtype=np.float64, count=rows) if fw is not None else None
                self._add_gram(a, x, x.astype(np.float64) if w is not None else x, w)
        xs.unlink(missing_ok=True)
        ws.unlink(missing_ok=True)
        self.spill_layers.discard(il)

    def take(self, il: int) -> LayerStats | None:
        """Layer `il`'s statistics (None where it saw no token), then forget them: one layer's Gram
        matrix in memory at a time for the spilled layers."""
        if il not in self.acc:
            return None
        if il in self.spill_layers:
            self._unspill(il)
        st = self.layer_stats(il)
        del self.acc[il]
        return st

    def layer_stats(self, il: int) -> LayerStats:
        a = self.acc[il]
        gram = a.gram
        if gram is not None and not isinstance(gram, np.ndarray):
            gram = gram.cpu().numpy()
        return LayerStats(a.count, a.sum, a.sumsq, a.sumabs, gram, a.wsum, a.wcount if a.wsum is not None else None)


class LlamaCalibrator(GraphEvaluator):
    """llama.cpp's graph evaluation of a file, for a calibration pass (runtime/llama/graph.py)."""

    purpose = "a calibration"


def require_llama_runs(src: SourceModel) -> None:
    """UnsupportedArchitecture unless the installed llama.cpp runs `src` (calibration runs it)."""
    ok, why = probe_architecture(src.path)
    if not ok:
        raise UnsupportedArchitecture(
            f"The installed llama.cpp (llama-cpp-python {llama_cpp_version()}) cannot run {src.path.name} "
            f"(architecture {src.info.architecture!r}: {why}); pruning calibrates through llama.cpp, so it needs a "
            "model llama.cpp runs. Upgrade llama-cpp-python or pick another model.")


def observe(src: SourceModel, probes: list[Probe], wins: list[list[int]], cfg: PruneConfig, desc: str, *,
            progress: bool, should_stop=None) -> None:
    """One pass of llama.cpp over the calibration windows with `probes` observing, a progress bar
    saying `desc`."""
    from tqdm import tqdm

    bar = tqdm(total=len(wins), desc=desc, unit="seq", disable=not progress)
    try:
        with LlamaCalibrator(src.path, n_ctx=cfg.seq_len, n_gpu_layers=cfg.n_gpu_layers, n_threads=cfg.threads) as cal:
            cal.run(probes, wins, progress=bar.update, should_stop=should_stop)
    finally:
        bar.close()


def gram_bytes(n_ff: int) -> int:
    """One layer's float64 Gram matrix."""
    return n_ff * n_ff * 8


def gram_groups(n_layer: int, n_ff: int, budget_bytes: int) -> list[list[int]]:
    """Split the layers into consecutive groups whose float64 Gram matrices fit `budget_bytes`."""
    size = max(1, int(budget_bytes // max(gram_bytes(n_ff), 1)))
    return [list(range(i, min(n_layer, i + size))) for i in range(0, n_layer, size)]
