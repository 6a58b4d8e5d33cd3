"""The model store: one copy of the weights per (file, weight options), contexts per load spec.

A `LoadSpec` is everything a caller can choose when loading (runtime/options/). Specs that differ only in
context options (n_ctx, threads, KV cache type, LoRA, ...) share one weights object: the file is
loaded once. A file replaced on disk (size or mtime changed) is noticed on the next `get` and loaded
anew. The store talks to engines through engine.py, never to llama.cpp itself.

Placement. `n_gpu_layers="auto"` (the default: what the language server and `a3b serve` ask for)
leaves the placement to the runtime, so such a spec attaches to the placement already loaded for its
file: the weights, and the whole loaded model when the other options match too. Resolving "auto"
again instead would give another answer once the first copy holds VRAM, and load the file twice. A
concrete placement attaches to a copy whose placement puts the same layers on the GPU (an "auto" load
that resolved to it included). Two placements of one file are loaded only when both were asked for
explicitly; the second copy's status warnings say so.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..engine import Engine, Model, ModelInfo, Weights, engine_for
from ..environment import env_number
from ..errors import ContextTooLarge
from . import memory
from ..options import LoadSpec

log = logging.getLogger("a3b.store")
#: the n_gpu_layers that leaves the placement to the runtime
AUTO = "auto"


class _Placed:
    """A spec over loaded weights (`weights_key`), and the placement `info` says they have."""

    spec: LoadSpec
    weights_key: tuple
    info: ModelInfo

    @property
    def placed(self) -> LoadSpec:
        """The spec with the placement as loaded ("auto" resolved)."""
        return placed(self.spec, self.info)

    def same_layers(self, spec: LoadSpec) -> bool:
        """Whether `spec` asks for this entry's placement (n_gpu_layers "auto" without an expert
        placement of its own: any placement)."""
        if spec.n_gpu_layers == AUTO and not spec.n_cpu_moe and not spec.cpu_moe:
            return True
        n_layer, mine = self.info.n_layer, self.placed

        def on_gpu(n: int) -> int:   # -1, and any count above the layers + output, mean everything
            return n_layer + 1 if n < 0 or n > n_layer else n
        if spec.n_gpu_layers != AUTO and (on_gpu(spec.n_gpu_layers) != on_gpu(mine.n_gpu_layers) if n_layer > 0
                                          else spec.n_gpu_layers != mine.n_gpu_layers):
            return False
        return spec.cpu_moe == mine.cpu_moe and (spec.cpu_moe or spec.n_cpu_moe == mine.n_cpu_moe)


@dataclass
class _Entry(_Placed):
    spec: LoadSpec
    model: Model
    weights_key: tuple
    est_bytes: int
    warnings: list[str] = field(default_factory=list)
    loaded_at: float = field(default_factory=time.time)

    @property
    def info(self) -> ModelInfo:
        return self.model.info


@dataclass(eq=False)
class _Opening(_Placed):
    """A model its engine is opening: its weights are taken (and found by the specs that may share
    them, as an entry's are) while the engine loads what the model needs beside them through the
    store, such as the draft model it drafts with."""

    spec: LoadSpec
    weights_key: tuple
    info: ModelInfo


def placed(spec: LoadSpec, info) -> LoadSpec:
    """`spec` with its "auto" placement as `info` says it was loaded (layers and expert layers)."""
    if spec.n_gpu_layers != AUTO:
        return spec
    return replace(spec, n_gpu_layers=info.n_gpu_layers, n_cpu_moe=info.n_cpu_moe)


@dataclass
class _Todo:
    """Models to wait for and weights to free after an unload (outside the store's lock)."""

    models: list[Model] = field(default_factory=list)
    weights: list[Weights] = field(default_factory=list)

    def add(self, other: _Todo) -> None:
        self.models += other.models
        self.weights += other.weights


class ModelStore:
    def __init__(self, budget_bytes: int | None = None):
        mib = env_number("A3B_MEMORY_BUDGET_MB", int) if budget_bytes is None else None
        self.budget_bytes = budget_bytes if budget_bytes is not None else (mib << 20 if mib is not None else None)
        self._lock = threading.RLock()
        self._entries: OrderedDict[LoadSpec, _Entry] = OrderedDict()
        self._weights: dict[tuple, Weights] = {}
        self._refs: dict[tuple, int] = {}        # weights key -> entries (and models opening) using those weights
        self._opening: list[_Opening] = []
        self.weight_loads = 0      # how many times a file was actually loaded
        self.context_creations = 0
        self.hits = 0
        self.evictions = 0
        self._listeners: list = []

    # -- lookup ------------------------------------------------------------------------------
    @staticmethod
    def _weights_key(spec: LoadSpec) -> tuple:
        engine = engine_for(spec.path)
        return (engine.name, *engine.weights_key(spec))

    def _find(self, spec: LoadSpec) -> _Entry | None:
        """The entry that serves `spec`: its own, or one that differs only in a placement `spec`
        leaves to the runtime or that puts the same layers on the GPU (module docstring)."""
        e = self._entries.get(spec)
        if e is not None:
            return e
        for e in reversed(self._entries.values()):   # the most recently used first
            if (e.spec.path == spec.path and e.same_layers(spec)
                    and replace(spec, n_gpu_layers=e.spec.n_gpu_layers, n_cpu_moe=e.spec.n_cpu_moe) == e.spec):
                return e
        return None

    def get(self, spec: LoadSpec) -> Model:
        """The loaded model for `spec`, loading it (and evicting LRU models over budget) if needed."""
        if self.peek(spec) is None:
            engine_for(spec.path).prepare(spec)   # an engine's slow part (a server's answers) outside the lock
        with self._lock:
            e = self._find(spec)
            if e is not None:
                try:
                    key = self._weights_key(e.placed)
                except OSError:
                    key = None
                if key == e.weights_key and e.model.alive:
                    self._entries.move_to_end(e.spec)
                    self.hits += 1
                    e.model.last_used = time.monotonic()
                    return e.model
                why = "file changed on disk" if key != e.weights_key else "closed"
                log.info("reloading %s: %s", spec.path, why)
                self._drop(e.spec, why)
            return self._load(spec)

    def entry(self, spec: LoadSpec) -> _Entry | None:
        with self._lock:
            return self._find(spec)

    def peek(self, spec: LoadSpec) -> Model | None:
        """The model loaded for `spec` if it is loaded and alive; never loads."""
        with self._lock:
            e = self._find(spec)
            return e.model if e is not None and e.model.alive else None

    def _loaded_weights(self, spec: LoadSpec) -> tuple | None:
        """The key of weights already loaded that `spec` may use (module docstring), or None."""
        for e in [*reversed(self._opening), *reversed(self._entries.values())]:   # the newest first
            if e.spec.path == spec.path and e.same_layers(spec) and e.weights_key in self._weights:
                try:
                    key = self._weights_key(replace(spec, n_gpu_layers=e.placed.n_gpu_layers,
                                                    n_cpu_moe=e.placed.n_cpu_moe))
                except OSError:
                    return None
                if key == e.weights_key:
                    return key
        return None

    def _current(self, e: _Placed) -> bool:
        """Whether `e` holds the file as it is on disk now (a replaced file is reloaded at its next use)."""
        try:
            return self._weights_key(e.placed) == e.weights_key
        except OSError:
            return False

    def _second_copy(self, spec: LoadSpec, w: Weights) -> list[str]:
        """Why the file of `spec` is now loaded twice, when it is: for its status warnings."""
        others = [e for e in [*self._entries.values(), *self._opening]
                  if e.spec.path == spec.path and e.weights_key in self._weights and self._current(e)]
        if not others:
            return []
        other = others[-1].placed
        differ = [f"n_gpu_layers {spec.n_gpu_layers} (placed {w.info.n_gpu_layers}) and {other.n_gpu_layers}"
                  if other.n_gpu_layers != w.info.n_gpu_layers else ""]
        differ += [f"{name} {getattr(spec, name)} and {getattr(other, name)}"
                   for name in ("use_mmap", "serve_as", "cpu_moe", "n_cpu_moe", "override_tensor")
                   if getattr(spec, name) != getattr(other, name)]
        msg = (f"{Path(spec.path).name} is loaded twice, as asked: two copies of its weights ("
               f"{'; '.join(d for d in differ if d)}). Ask for one placement (or n_gpu_layers 'auto') and the "
               "same use_mmap and serve_as to share one copy.")
        log.warning(msg)
        return [msg]

    def _load(self, spec: LoadSpec) -> Model:
        spec.validate()
        memory.tune_allocator()
        engine: Engine = engine_for(spec.path)
        engine.check(spec)
        key = self._loaded_weights(spec)
        if key is None:
            key = self._weights_key(spec)
        if key not in self._weights:
            self._make_room(engine.file_bytes(spec))
        w = self._weights.get(key)
        warnings: list[str] = []
        if w is None:
            w = engine.load_weights(spec)
            if spec.n_gpu_layers == AUTO:   # keyed by the placement it resolved to
                key = self._weights_key(placed(spec, w.info))
                if key in self._weights:   # a copy so placed is loaded already (its spec was no match)
                    w.free()
                    w = self._weights[key]
            if key not in self._weights:
                warnings = self._second_copy(spec, w)
                self._weights[key] = w
                self._refs[key] = 0
                self.weight_loads += 1
        try:
            n_train = w.info.n_ctx_train
            if n_train and spec.n_ctx > n_train:
                msg = (f"n_ctx={spec.n_ctx} is beyond {Path(spec.path).name}'s trained context of "
                       f"{n_train} tokens; output past that length degrades.")
                if spec.ctx_policy == "refuse":
                    raise ContextTooLarge(msg + f" Use n_ctx <= {n_train}.")
                log.warning(msg)
                warnings.append(msg)
            kv = engine.kv_bytes(w, spec)
            self._make_room(kv, keep=key)
            # the weights are the model's while it opens: a model it loads through the store (its
            # draft model, an entry of its own) finds them and neither evicts nor frees them
            opening = _Opening(spec, key, w.info)
            self._refs[key] += 1
            self._opening.append(opening)
            try:
                model = engine.open_model(w, spec, self.get)
            finally:
                self._opening.remove(opening)
                self._refs[key] -= 1
        except BaseException:
            if self._refs.get(key, 0) == 0:
                self._weights.pop(key, None)
                self._refs.pop(key, None)
                w.free()
            raise
        self._refs[key] += 1
        self.context_creations += 1
        self._entries[spec] = _Entry(spec, model, key, kv, warnings)
        self._notify("loaded", spec)
        return model

    # -- memory --------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        with self._lock:
            return (sum(w.info.size_bytes for w in self._weights.values())
                    + sum(e.est_bytes for e in self._entries.values()))

    def _make_room(self, need: int, keep: tuple | None = None) -> None:
        if self.budget_bytes is None:
            return
        for spec in list(self._entries):  # oldest first
            if self.memory_bytes() + need <= self.budget_bytes:
                return
            e = self._entries[spec]
            if e.model.busy() or (keep is not None and e.weights_key == keep):
                continue
            log.info("evicting %s (memory budget %d MB)", spec.path, self.budget_bytes >> 20)
            self.evictions += 1
            self._drop(spec, "evicted for memory")
        if self.memory_bytes() + need > self.budget_bytes:
            log.warning("memory budget of %d MB exceeded: every loaded model is busy", self.budget_bytes >> 20)

    # -- unloading ------------------------------------------------------------------------------
    def _detach(self, spec: LoadSpec, reason: str) -> _Todo:
        """Remove `spec` from the store and stop its model (with the lock held); return what is left
        to wait for and free. Waiting happens outside the lock: a request's callback that reads the
        store while its model shuts down must not deadlock."""
        todo = _Todo()
        e = self._entries.pop(spec, None)
        if e is None:
            return todo
        e.model.close(reason, wait=False)
        todo.models.append(e.model)
        key = e.weights_key
        if key in self._weights:
            self._refs[key] -= 1
            if self._refs[key] <= 0:
                todo.weights.append(self._weights.pop(key))
                del self._refs[key]
        self._notify("unloaded", spec)
        return todo

    @staticmethod
    def _finalize(todo: _Todo) -> None:
        for m in todo.models:  # models first (their contexts), then the weights they used
            m.closed.wait()
        for w in todo.weights:
            w.free()  # waits for threads still inside a vocabulary call
        if todo.models or todo.weights:
            memory.release(force=True)

    def _drop(self, spec: LoadSpec, reason: str) -> None:
        self._finalize(self._detach(spec, reason))

    def unload(self, spec: LoadSpec | None = None, reason: str = "unloaded") -> int:
        """Unload one spec (or all). Running requests end with ModelUnloaded; memory is freed after."""
        todo = _Todo()
        with self._lock:
            specs = [spec] if spec is not None else list(self._entries)
            n = 0
            for s in specs:
                e = self._find(s)
                if e is not None:
                    todo.add(self._detach(e.spec, reason))
                    n += 1
        self._finalize(todo)
        return n

    @contextlib.contextmanager
    def loads_held(self):
        """No model loads while inside (other threads' requests wait): for looking at a process with
        nothing loaded, as the soak benchmark does right after an unload."""
        with self._lock:
            yield

    def loaded(self) -> list[_Entry]:
        with self._lock:
            return list(self._entries.values())

    def add_listener(self, fn) -> None:
        """fn(event, spec) after a model is "loaded" or "unloaded" (called with the store's lock held)."""
        self._listeners.append(fn)

    def remove_listener(self, fn) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def _notify(self, event: str, spec: LoadSpec) -> None:
        for fn in list(self._listeners):
            try:
                fn(event, spec)
            except Exception:
                log.exception("store listener failed")

