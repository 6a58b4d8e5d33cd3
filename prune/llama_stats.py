"""Calibration statistics from llama.cpp's own graph evaluation (any architecture it runs; no torch).

llama.cpp calls a graph evaluation callback (`cb_eval` in the context parameters) twice per graph
node: first with ask=True ("do you want this tensor?"), then, for the nodes the callback wanted,
with ask=False once the node is computed. This is the mechanism of llama.cpp's imatrix tool. Here a
set of `Probe`s decides which nodes to observe and what to accumulate; the model runs as llama.cpp
loads it (quantised, on the CPU or with layers offloaded to a GPU, whose tensors are copied to host
memory before they are read).

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

import logging
import os
import re
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import numpy as np

from ..runtime.errors import InvalidRequest, ModelLoadFailed
from . import ggml
from .calibrate import LayerStats
from .llama_context import LlamaContext

log = logging.getLogger("comfyui_a3b.prune")

_FFN_DOWN = re.compile(r"^blk\.(\d+)\.ffn_down\.weight$")


class Probe:
    """One kind of statistic gathered from llama.cpp's graph evaluation."""

    def match(self, node: ggml.TensorView) -> Hashable | None:
        """At ask time: a key if this node should be observed, else None. Must be cheap."""
        raise NotImplementedError

    def record(self, key: Hashable, node: ggml.TensorView) -> None:
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

    def __init__(self, pattern: str, on_node: Callable[[Hashable, ggml.TensorView], None], *,
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
                 device: str = "cpu", weighted: bool = False):
        self.n_layer = n_layer
        self.layers = set(range(n_layer)) if layers is None else set(layers)
        self.gram_layers = set(gram_layers)
        self.device = device
        self.weighted = weighted
        self.acc: dict[int, _Acc] = {}
        self._torch = None
        if self.gram_layers and device != "cpu":
            from .errors import require_torch

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

    def token_weights(self, node: ggml.TensorView) -> np.ndarray:
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
        if self._torch is not None:
            t = self._torch
            if w is None:
                xt = t.from_numpy(x).to(self.device)
                g = (xt.T @ xt).double()
            else:
                xt = t.from_numpy(xd).to(self.device)  # float64 already
                g = (xt * t.from_numpy(w).to(self.device)[:, None]).T @ xt
            a.gram = g if a.gram is None else a.gram + g
        else:
            g = (x.T @ x).astype(np.float64) if w is None else (xd * w[:, None]).T @ xd
            a.gram = g if a.gram is None else a.gram + g

    def layer_stats(self, il: int) -> LayerStats:
        a = self.acc[il]
        gram = a.gram
        if gram is not None and not isinstance(gram, np.ndarray):
            gram = gram.cpu().numpy()
        return LayerStats(a.count, a.sum, a.sumsq, a.sumabs, gram, a.wsum, a.wcount if a.wsum is not None else None)


class LlamaCalibrator(LlamaContext):
    """One llama.cpp model and context whose graph evaluation feeds `Probe`s.

    `n_gpu_layers`: layers offloaded to a GPU (0: CPU only, -1: all); a GPU asked of a CPU-only
    build of llama-cpp-python is a clear error.
    """

    purpose = "a calibration"

    def __init__(self, path: str | os.PathLike, n_ctx: int, n_gpu_layers: int = 0, n_threads: int = 0):
        from ..runtime.llama import llama

        if n_gpu_layers != 0 and not llama().llama_supports_gpu_offload():
            raise InvalidRequest(
                f"--n-gpu-layers {n_gpu_layers} asks for the GPU, but the installed llama-cpp-python was built for "
                "the CPU only. Use --n-gpu-layers 0, or install a GPU build (CMAKE_ARGS=\"-DGGML_CUDA=on\" pip "
                "install --force-reinstall --no-cache-dir llama-cpp-python).")
        self.probes: list[Probe] = []
        self._wanted: dict[int, list[tuple[Probe, Hashable]]] = {}
        self._stop_after: set[tuple[int, Hashable]] = set()
        self._stopped = False
        self._error: BaseException | None = None
        self._cb = ggml.EVAL_CALLBACK(self._callback)  # kept alive as long as the context
        # no CPU repacking: the weights llama.cpp keeps on the CPU stay pages of the memory-mapped file
        # (page cache), not an anonymous copy of the model, so calibration's memory stays bounded
        super().__init__(path, n_ctx, n_threads, n_gpu_layers, repack=False, cb_eval=self._cb)

    # -- the callback -----------------------------------------------------------------------------
    def _callback(self, ptr, ask, _user) -> bool:
        try:
            node = ggml.TensorView(ptr)
            if ask:
                hits = [(probe, key) for probe in self.probes if (key := probe.match(node)) is not None]
                if hits:
                    self._wanted[ptr] = hits
                return bool(hits)
            hits = self._wanted.get(ptr)
            for probe, key in hits or ():
                probe.record(key, node)
                if (id(probe), key) in self._stop_after:
                    self._done.add(id(probe))
            if hits and len(self._done) == len(self.probes):
                self._stopped = True
                return False  # nothing later in the graph is needed: cancel the rest of it
            return True
        except BaseException as e:  # noqa: BLE001 - an exception must not cross into C; re-raised after decode
            self._error = e
            return False

    def run(self, probes: list[Probe], windows: Iterable[list[int]], *, progress: Callable[[int], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> None:
        """Evaluate every window (one sequence each, from an empty cache) with `probes` observing."""
        from ..runtime.llama import fill_batch, llama, sequence

        L = llama()
        self.probes = probes
        self._stop_after = {(id(p), p.last_key()) for p in probes if p.last_key() is not None}
        for w in windows:
            if should_stop is not None and should_stop():
                raise KeyboardInterrupt
            if len(w) > self.n_ctx:
                raise ValueError(f"a window of {len(w)} tokens exceeds the calibration context of {self.n_ctx}")
            self._wanted.clear()
            self._done: set[int] = set()
            self._stopped = False
            self._error = None
            L.llama_memory_clear(self.mem, True)
            # every position is an output: llama.cpp drops the positions without one before the
            # last layer's FFN, which would then see only the last token
            fill_batch(self.batch, sequence(list(w), 0, all_logits=True))
            rc = L.llama_decode(self.ctx, self.batch)
            if self._error is not None:
                raise self._error
            if rc != 0 and not self._stopped:
                raise ModelLoadFailed(f"llama_decode failed with status {rc} during calibration")
            if progress is not None:
                progress(1)


def gram_groups(n_layer: int, n_ff: int, budget_bytes: int) -> list[list[int]]:
    """Split the layers into consecutive groups whose float64 Gram matrices fit `budget_bytes`."""
    per = n_ff * n_ff * 8
    size = max(1, int(budget_bytes // max(per, 1)))
    return [list(range(i, min(n_layer, i + size))) for i in range(0, n_layer, size)]
