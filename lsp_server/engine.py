"""What every connection of a process shares: the runtime, the completion cache, vectors and statistics.

One Engine per process; each editor connection's Session (session.py) holds it.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..runtime import get_runtime
from . import config as cfg
from .cache import CompletionCache
from .context import VectorCache
from .prompt import PromptBuilder


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Stats:
    """Counters and recent latencies, for the status command and the benchmark."""

    def __init__(self):
        self.c = collections.Counter()
        self.latencies: collections.deque[tuple[float, str, bool]] = collections.deque(maxlen=4096)
        self.lock = threading.Lock()

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.c[key] += n

    def answered(self, seconds: float, source: str, multiline: bool) -> None:
        with self.lock:
            self.latencies.append((seconds * 1000.0, source, multiline))
            self.c[f"answered_{source}"] += 1

    def summary(self) -> dict[str, Any]:
        with self.lock:
            lat = list(self.latencies)
            c = dict(self.c)
        single = [ms for ms, _, ml in lat if not ml]
        out = {"counters": c, "answered": len(lat)}
        for name, xs in (("all", [ms for ms, *_ in lat]), ("single_line", single),
                         ("multi_line", [ms for ms, _, ml in lat if ml])):
            out[f"latency_ms_{name}"] = {"p50": _percentile(xs, 0.5), "p95": _percentile(xs, 0.95),
                                          "p99": _percentile(xs, 0.99), "n": len(xs)}
        return out


class Engine:
    """What all connections of a process share: the runtime, the cache, vectors and statistics."""

    def __init__(self, runtime=None, default_model: str | None = None, address: str | None = None):
        self.rt = runtime or get_runtime()
        #: The model named on the command line: trusted, so any path is fine. Models named over the
        #: protocol are restricted to the model folders (`resolve_model(restrict=True)`).
        self.default_model = default_model
        self.address = address
        self.cache = CompletionCache()
        self.vectors = VectorCache()
        self.stats = Stats()
        #: threads that wait on interactive work (a completion's generation, a model load)
        self.executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="a3b-lsp")
        #: threads for background work (choosing context chunks, warming prompts): kept apart so
        #: that no amount of it can delay a completion's turn for a thread
        self.background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="a3b-lsp-bg")
        self.sessions: set = set()             # the connections' sessions (session.py)
        self.started = time.time()

    def spec_for(self, settings: cfg.Settings):
        load = {k: getattr(settings, k) for k in cfg.LOAD_FIELDS}
        lora = cfg.lora_path(settings.lora)
        if lora:
            load.update(lora_path=lora, lora_scale=settings.lora_scale)
        if settings.model is None:
            return self.rt.spec(self.default_model, **load)
        return self.rt.spec(settings.model, restrict=True, **load)

    def builder(self, model) -> PromptBuilder:
        return PromptBuilder(model)   # holds nothing but the model: an unloaded model is not kept alive

    def status(self) -> dict[str, Any]:
        st = self.stats.summary()
        st["cache"] = self.cache.stats()
        st["clients"] = len(self.sessions)
        st["address"] = self.address
        st["embedded_chunks"] = self.vectors.embedded
        st["uptime_s"] = round(time.time() - self.started, 1)
        return st

    def close(self) -> None:
        for s in list(self.sessions):
            s.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.background.shutdown(wait=False, cancel_futures=True)
