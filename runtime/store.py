"""The model store: one loaded llama_model per (file, weight options), contexts per load spec.

A `LoadSpec` is everything a caller can choose when loading. Specs that differ only in context
options (n_ctx, threads, KV cache type, LoRA, ...) share one `Weights` object: the file is loaded once.
A file replaced on disk (size or mtime changed) is noticed on the next `get` and loaded anew.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ContextTooLarge
from .gguf_info import check_header
from .llama_engine import ContextOptions, LoadedModel, Weights
from .options import LoadSpec
from .serving import serving_path

log = logging.getLogger("a3b.store")


def context_options(spec: LoadSpec) -> ContextOptions:
    return ContextOptions(n_ctx=spec.n_ctx, n_parallel=spec.n_parallel, n_batch=spec.n_batch,
                          n_threads=spec.n_threads, flash_attn=spec.flash_attn,
                          kv_cache_type=spec.kv_cache_type, lora_path=spec.lora_path,
                          lora_scale=spec.lora_scale, embed_n_ctx=spec.embed_n_ctx)


_KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
             "q4_1": 20 / 32, "q4_0": 18 / 32}


def kv_bytes(w: Weights, spec: LoadSpec) -> int:
    """Size of the generation context's KV cache for this spec (all slots, all cells)."""
    n_embd_kv = w.n_embd * (w.n_head_kv or w.n_head) // max(w.n_head, 1)
    per_token = w.n_layer * 2 * n_embd_kv * _KV_BYTES.get(spec.kv_cache_type, 2)
    return int(per_token * spec.n_ctx * spec.n_parallel)


@dataclass
class _Entry:
    spec: LoadSpec
    model: LoadedModel
    weights_key: tuple
    est_bytes: int
    warnings: list[str] = field(default_factory=list)
    loaded_at: float = field(default_factory=time.time)


class ModelStore:
    def __init__(self, budget_bytes: int | None = None):
        env = os.environ.get("A3B_MEMORY_BUDGET_MB")
        self.budget_bytes = budget_bytes if budget_bytes is not None else (int(env) << 20 if env else None)
        self._lock = threading.RLock()
        self._entries: "OrderedDict[LoadSpec, _Entry]" = OrderedDict()
        self._weights: dict[tuple, Weights] = {}
        self.weight_loads = 0      # how many times a file was actually loaded
        self.context_creations = 0
        self.hits = 0
        self.evictions = 0
        self._listeners: list = []

    # -- lookup ------------------------------------------------------------------------------
    @staticmethod
    def _weights_key(spec: LoadSpec) -> tuple:
        st = os.stat(spec.path)
        return (spec.path, st.st_size, st.st_mtime_ns, spec.n_gpu_layers, spec.use_mmap, spec.serve_as)

    def get(self, spec: LoadSpec) -> LoadedModel:
        """The loaded model for `spec`, loading it (and evicting LRU models over budget) if needed."""
        with self._lock:
            e = self._entries.get(spec)
            if e is not None:
                try:
                    key = self._weights_key(spec)
                except OSError:
                    key = None
                if key == e.weights_key and not e.model.closed.is_set() and not e.model._closing:
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

    def _load(self, spec: LoadSpec) -> LoadedModel:
        spec.validate()
        # Missing and foreign files fail here with a typed error. The rest of the checks come from
        # llama.cpp's own loader (truncation, unknown architecture), which reads the metadata in a
        # fraction of the time the `gguf` package's full reader needs (~3 s for a 49k vocabulary).
        check_header(spec.path)
        key = self._weights_key(spec)
        if key not in self._weights:
            self._make_room(os.path.getsize(spec.path))
        w = self._weights.get(key)
        new_weights = w is None
        if new_weights:
            load_path = serving_path(spec.path, spec.serve_as) if spec.serve_as != "as-is" else Path(spec.path)
            w = Weights(load_path, n_gpu_layers=spec.n_gpu_layers, use_mmap=spec.use_mmap)
            self._weights[key] = w
            self.weight_loads += 1
        try:
            warnings = []
            if w.n_ctx_train and spec.n_ctx > w.n_ctx_train:
                msg = (f"n_ctx={spec.n_ctx} is beyond {Path(spec.path).name}'s trained context of "
                       f"{w.n_ctx_train} tokens; output past that length degrades.")
                if spec.ctx_policy == "refuse":
                    raise ContextTooLarge(msg + f" Use n_ctx <= {w.n_ctx_train}.")
                log.warning(msg)
                warnings.append(msg)
            self._make_room(kv_bytes(w, spec), keep=key)
            model = LoadedModel(w, context_options(spec), name=Path(spec.path).name)
        except BaseException:
            if w.refs == 0:
                self._weights.pop(key, None)
                w.free()
            raise
        w.refs += 1
        self.context_creations += 1
        self._entries[spec] = _Entry(spec, model, key, kv_bytes(w, spec), warnings)
        self._notify("loaded", spec)
        return model

    # -- memory --------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        with self._lock:
            return sum(w.size_bytes for w in self._weights.values()) + sum(e.est_bytes for e in self._entries.values())

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
    def _detach(self, spec: LoadSpec, reason: str) -> list:
        """Remove `spec` from the store and stop its model (with the lock held); return what is left
        to wait for and free. Waiting happens outside the lock: a request's callback that reads the
        store while its model shuts down must not deadlock."""
        e = self._entries.pop(spec, None)
        if e is None:
            return []
        e.model.close(reason, wait=False)
        w = self._weights.get(e.weights_key)
        todo: list = [e.model]
        if w is not None:
            w.refs -= 1
            if w.refs <= 0:
                del self._weights[e.weights_key]
                todo.append(w)
        self._notify("unloaded", spec)
        return todo

    @staticmethod
    def _finalize(todo: list) -> None:
        for obj in todo:  # models first (their contexts), then the weights they used
            if isinstance(obj, LoadedModel):
                obj.closed.wait()
        for obj in todo:
            if isinstance(obj, Weights):
                obj.free()

    def _drop(self, spec: LoadSpec, reason: str) -> None:
        self._finalize(self._detach(spec, reason))

    def unload(self, spec: LoadSpec | None = None, reason: str = "unloaded") -> int:
        """Unload one spec (or all). Running requests end with ModelUnloaded; memory is freed after."""
        todo: list = []
        with self._lock:
            specs = [spec] if spec is not None else list(self._entries)
            n = 0
            for s in specs:
                if s in self._entries:
                    todo += self._detach(s, reason)
                    n += 1
        self._finalize(todo)
        return n

    def loaded(self) -> list[_Entry]:
        with self._lock:
            return list(self._entries.values())

    def add_listener(self, fn) -> None:
        self._listeners.append(fn)

    def _notify(self, event: str, spec: LoadSpec) -> None:
        for fn in list(self._listeners):
            try:
                fn(event, spec)
            except Exception:
                log.exception("store listener failed")

