"""Watch llama.cpp compute: its graph evaluation callback, with observers that choose nodes and read them.

llama.cpp calls a graph evaluation callback (`cb_eval` in the context parameters) twice per graph
node: first with ask=True ("do you want this tensor?"), then, for the nodes the callback wanted,
with ask=False once the node is computed. This is the mechanism of llama.cpp's imatrix tool. A
`GraphEvaluator` runs windows of tokens through a model as llama.cpp loads it (quantised, on the CPU
or with layers offloaded to a GPU, whose tensors are copied to host memory before they are read) and
hands the nodes to `Observer`s: each one's `match` sees every node (a ggml.TensorView: operation,
name, shape, sources) at ask time and returns a key for the nodes it wants, `record` gets those nodes
computed, and `last_key` names the node after which the observer needs nothing more, so that a pass
stops llama.cpp as soon as every observer has what it wants. What to observe and what to gather is
the caller's (the pruning tool's statistics); this module only runs llama.cpp.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol

from ..errors import InvalidRequest, ModelLoadFailed
from . import ggml
from .binding import fill_batch, llama, sequence
from .evaluate import LlamaContext


class Observer(Protocol):
    def match(self, node: ggml.TensorView) -> Hashable | None:
        """At ask time: a key if this node should be observed, else None. Must be cheap."""

    def record(self, key: Hashable, node: ggml.TensorView) -> None:
        """The node `match` chose, computed."""

    def last_key(self) -> Hashable | None:
        """The key after which nothing more is needed from the graph (None: run it to the end)."""


class GraphEvaluator(LlamaContext):
    """One llama.cpp model and context whose graph evaluation feeds `Observer`s.

    `n_gpu_layers`: layers offloaded to a GPU (0: CPU only, -1: all); a GPU asked of a CPU-only
    build of llama-cpp-python is a clear error.
    """

    purpose = "a graph evaluation"

    def __init__(self, path: str | os.PathLike, n_ctx: int, n_gpu_layers: int = 0, n_threads: int = 0, *,
                 purpose: str | None = None):
        if purpose:
            self.purpose = purpose  # named in llama.cpp's errors ("a calibration")
        if n_gpu_layers != 0 and not llama().llama_supports_gpu_offload():
            raise InvalidRequest(
                f"--n-gpu-layers {n_gpu_layers} asks for the GPU, but the installed llama-cpp-python was built for "
                "the CPU only. Use --n-gpu-layers 0, or install a GPU build (CMAKE_ARGS=\"-DGGML_CUDA=on\" pip "
                "install --force-reinstall --no-cache-dir llama-cpp-python).")
        self.observers: list[Observer] = []
        self._wanted: dict[int, list[tuple[Observer, Hashable]]] = {}
        self._stop_after: set[tuple[int, Hashable]] = set()
        self._done: set[int] = set()
        self._stopped = False
        self._error: BaseException | None = None
        self._cb = ggml.EVAL_CALLBACK(self._callback)  # kept alive as long as the context
        # no CPU repacking: the weights llama.cpp keeps on the CPU stay pages of the memory-mapped file
        # (page cache), not an anonymous copy of the model, so an observed pass's memory stays bounded
        super().__init__(path, n_ctx, n_threads, n_gpu_layers, repack=False, cb_eval=self._cb)

    def _callback(self, ptr, ask, _user) -> bool:
        try:
            node = ggml.TensorView(ptr)
            if ask:
                hits = [(o, key) for o in self.observers if (key := o.match(node)) is not None]
                if hits:
                    self._wanted[ptr] = hits
                return bool(hits)
            hits = self._wanted.get(ptr)
            for o, key in hits or ():
                o.record(key, node)
                if (id(o), key) in self._stop_after:
                    self._done.add(id(o))
            if hits and len(self._done) == len(self.observers):
                self._stopped = True
                return False  # nothing later in the graph is needed: cancel the rest of it
            return True
        except BaseException as e:  # noqa: BLE001 - an exception must not cross into C; re-raised after decode
            self._error = e
            return False

    def run(self, observers: list[Observer], windows: Iterable[list[int]], *,
            progress: Callable[[int], None] | None = None, should_stop: Callable[[], bool] | None = None) -> None:
        """Evaluate every window (one sequence each, from an empty cache) with `observers` watching."""
        L = llama()
        self.observers = observers
        self._stop_after = {(id(o), o.last_key()) for o in observers if o.last_key() is not None}
        for w in windows:
            if should_stop is not None and should_stop():
                raise KeyboardInterrupt
            if len(w) > self.n_ctx:
                raise ValueError(f"a window of {len(w)} tokens exceeds the context of {self.n_ctx}")
            self._wanted.clear()
            self._done = set()
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
                raise ModelLoadFailed(f"llama_decode failed with status {rc} during {self.purpose}")
            if progress is not None:
                progress(1)
