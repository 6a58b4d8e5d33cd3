"""The model store: one copy of the weights per (file, weight options), contexts per load spec.

A `LoadSpec` is everything a caller can choose when loading (options.py). Specs that differ only in
context options (n_ctx, threads, KV cache type, LoRA, ...) share one weights object: the file is
loaded once. A file replaced on disk (size or mtime changed) is noticed on the next `get` and loaded
anew. The store talks to engines through engine.py, never to llama.cpp itself.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from .engine import Engine, Model, Weights, engine_for
from .errors import ContextTooLarge
from . import memory
from .options import LoadSpec

log = logging.getLogger("a3b.store")


@dataclass
class _Entry:
    spec: LoadSpec
    model: Model
    weights_key: tuple
    est_bytes: int
    warnings: list[str] = field(default_factory=list)
    loaded_at: float = field(default_factory=time.time)


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
        env = os.environ.get("A3B_MEMORY_BUDGET_MB")
        self.budget_bytes = budget_bytes if budget_bytes is not None else (int(env) << 20 if env else None)
        self._lock = threading.RLock()
        self._entries: OrderedDict[LoadSpec, _Entry] = OrderedDict()
        self._weights: dict[tuple, Weights] = {}
        self._refs: dict[tuple, int] = {}        # weights key -> entries using those weights
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

    def get(self, spec: LoadSpec) -> Model:
        """The loaded model for `spec`, loading it (and evicting LRU models over budget) if needed."""
        if self.peek(spec) is None:
            engine_for(spec.path).prepare(spec)   # an engine's slow part (a server's answers) outside the lock
        with self._lock:
            e = self._entries.get(spec)
            if e is not None:
                try:
                    key = self._weights_key(spec)
                except OSError:
                    key = None
                if key == e.weights_key and e.model.alive:
                    self._entries.move_to_end(spec)
                    self.hits += 1
                    e.model.last_used = time.monotonic()
                    return e.model
                why = "file changed on disk" if key != e.weights_key else "closed"
                log.info("reloading %s: %s", spec.path, why)
                self._drop(spec, why)
            return self._load(spec)

    def entry(self, spec: LoadSpec) -> _Entry | None:
        with self._lock:
            return self._entries.get(spec)

    def peek(self, spec: LoadSpec) -> Model | None:
        """The model loaded for `spec` if it is loaded and alive; never loads."""
        with self._lock:
            e = self._entries.get(spec)
            return e.model if e is not None and e.model.alive else None

    def _load(self, spec: LoadSpec) -> Model:
        spec.validate()
        memory.tune_allocator()
        engine: Engine = engine_for(spec.path)
        engine.check(spec)
        key = self._weights_key(spec)
        if key not in self._weights:
            self._make_room(engine.file_bytes(spec))
        w = self._weights.get(key)
        if w is None:
            w = engine.load_weights(spec)
            self._weights[key] = w
            self._refs[key] = 0
            self.weight_loads += 1
        try:
            warnings = []
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
            model = engine.open_model(w, spec)
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
                if s in self._entries:
                    todo.add(self._detach(s, reason))
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

