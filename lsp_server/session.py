"""Process-wide and per-connection state of the language server.

One Engine per process, shared by every editor connection: the runtime, the completion cache,
vectors and statistics. One Session per connection: its documents, settings and model, the warming
of prompts where the cursor rests, and the choice of context chunks from other open files. How a
Session answers a completion is in completion.py (`Completer`).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from ..runtime import PRIORITY_BATCH, ConfidenceConfig, get_runtime, preset
from ..runtime.errors import A3BError
from . import config as cfg
from .cache import CompletionCache
from .completion import Completer, Gen, _wait_stream
from .context import ContextIndex, VectorCache, render_block
from .documents import Cursor, Document, DocumentError
from .prompt import PromptBuilder

log = logging.getLogger("a3b.lsp")


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
        self.sessions: set[Session] = set()
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


class Session(Completer):
    """One editor connection: its documents, settings, and at most one running completion."""

    def __init__(self, engine: Engine, notify: Callable[[str, str], None] | None = None):
        self.engine = engine
        self.settings = cfg.Settings()
        self.docs: dict[str, Document] = {}
        self.encoding = "utf-16"
        self.index = ContextIndex(engine.vectors)
        self.gen: Gen | None = None
        self.latest = 0
        self.anchors: dict[str, int] = {}
        self.context: dict[str, tuple[str, list[str]]] = {}     # uri -> (prompt head, files)
        self._selecting: set[str] = set()
        self._spec = None
        self._tasks: set[asyncio.Future] = set()
        self._background: set = set()          # streams of prompts warmed at batch priority
        self._warm_timer: asyncio.TimerHandle | None = None
        self.notify = notify or (lambda level, msg: None)
        self.closed = False
        engine.sessions.add(self)

    # -- settings and model ------------------------------------------------------------------
    def configure(self, raw: Any) -> list[str]:
        new, errors = cfg.apply(self.settings, raw)
        if any(getattr(new, k) != getattr(self.settings, k) for k in ("model", "lora", "lora_scale", *cfg.LOAD_FIELDS)):
            try:
                spec = self.engine.spec_for(new)  # resolve now: a bad model name is reported, not kept
            except A3BError as e:
                errors.append(f"A3B model setting rejected: {e} Keeping {self.settings.model or 'the default model'}.")
                new = replace(new, model=self.settings.model, lora=self.settings.lora,
                              lora_scale=self.settings.lora_scale,
                              **{k: getattr(self.settings, k) for k in cfg.LOAD_FIELDS})
            else:
                self._spec = spec
                self.anchors.clear()
                self.context.clear()
        self.settings = new
        return errors

    def spec(self):
        if self._spec is None:
            self._spec = self.engine.spec_for(self.settings)
        return self._spec

    def model_if_loaded(self):
        return self.engine.rt.loaded(self.spec())

    async def model(self, progress: Callable[[str], Any] | None = None):
        m = self.model_if_loaded()
        if m is not None:
            return m
        spec = self.spec()
        done = progress(os.path.basename(spec.path)) if progress else None
        try:
            t0 = time.perf_counter()
            m = await asyncio.get_running_loop().run_in_executor(self.engine.executor, self.engine.rt.load, spec)
            self.engine.stats.count("model_loads")
            log.info("loaded %s in %.0f ms", spec.path, (time.perf_counter() - t0) * 1000)
            return m
        finally:
            if done:
                done()

    # -- documents -----------------------------------------------------------------------------
    def doc(self, uri: str) -> Document:
        d = self.docs.get(uri)
        if d is None:
            raise DocumentError(f"{uri} is not open; send textDocument/didOpen first.")
        return d

    def open(self, uri: str, text: str, version: int, language_id: str) -> None:
        self.docs[uri] = Document(uri, text, version, language_id)
        self.index.set_document(uri, text, self.settings.chunk_tokens)

    def change(self, uri: str, version: int, changes: list) -> None:
        d = self.doc(uri)
        where = None
        for ch in changes:
            where = d.apply(ch, self.encoding)
        d.version = version
        self.index.set_document(uri, d.snapshot(), self.settings.chunk_tokens)   # joined only if indexed
        if where is not None:
            self.hint(uri, where)   # the user is typing here
        g = self.gen
        if g is not None and not g.done.done() and g.cur.uri == uri:
            if self._typed_ahead(g, d):
                g.keep_alive = True
            else:
                g.cancel("document changed")
                self.engine.stats.count("cancelled_by_edit")

    # -- warming: the prompt's stable part is read before the user asks ---------------------------
    WARM_PAUSE_S = 0.3

    def hint(self, uri: str, offset: int) -> None:
        """The user's cursor is at `offset` of `uri` (an edit just happened there, or the editor said so
        with `a3b/cursor`). After a short pause, read the prompt a completion there would use, at batch
        priority, so the first request costs what later ones do: only its last few tokens are new.
        llama.vim warms its cache the same way when the cursor rests."""
        if self.closed or not self.settings.warm:
            return
        if self._warm_timer is not None:
            self._warm_timer.cancel()
        self._warm_timer = asyncio.get_running_loop().call_later(self.WARM_PAUSE_S, self._warm, uri, offset)

    def hint_position(self, uri: str, position) -> None:
        d = self.docs.get(uri)
        if d is not None:
            self.hint(uri, d.offset_at(position, self.encoding, "cursor"))

    def _warm(self, uri: str, offset: int) -> None:
        self._warm_timer = None
        d = self.docs.get(uri)
        m = self.model_if_loaded()
        if d is None or m is None or self.closed or (self.gen is not None and not self.gen.done.done()):
            return   # a running completion reads its own prompt
        try:
            d.check_usable(self.settings.max_document_bytes)
            cur = d.cursor_at(min(offset, len(d)))
        except DocumentError:
            return
        builder = self.engine.builder(m)
        try:
            prompt = self._prompt(builder, cur, self.use_fim(builder))
            stream = self.engine.rt.submit(prompt.sent, model=self.spec(), max_tokens=1,
                                           sampling=preset("greedy"), priority=PRIORITY_BATCH,
                                           confidence=ConfidenceConfig(enabled=False))
        except A3BError as e:   # unloaded meanwhile, say: warming is a hint, never an error
            log.debug("warming skipped: %s", e)
            return
        self._track_background(stream, "warmed_tokens")

    def _track_background(self, stream, counter: str) -> None:
        """Count what a background prefill read; forget it when done; cancel it if the session ends."""
        self._background.add(stream)

        def wait():
            res, _ = _wait_stream(stream)
            self._background.discard(stream)
            if res is not None:
                self.engine.stats.count(counter, res.n_prompt_tokens - res.n_cached_prompt_tokens)

        self.engine.background.submit(wait)

    def close_doc(self, uri: str) -> None:
        self.docs.pop(uri, None)
        self.anchors.pop(uri, None)
        self.context.pop(uri, None)
        self.index.set_document(uri, None, 0)

    # -- context from other files --------------------------------------------------------------
    def _prompt(self, builder: PromptBuilder, cur: Cursor, use_fim: bool):
        """The prompt for `cur`: the file's window keeps its anchor while the cursor stays in it, so
        the prompt's start (and its KV cache) stays the same; a new window also starts choosing
        context chunks for it in the background."""
        s = self.settings
        head, files = self.context.get(cur.uri, ("", []))
        prev = self.anchors.get(cur.uri)
        prompt = builder.build(cur, anchor=prev, context_block=head, budget=s.context_tokens,
                               suffix_tokens=s.suffix_tokens, use_fim=use_fim, context_files=files)
        if prompt.anchor != prev:
            self.anchors[cur.uri] = prompt.anchor
            self._select_context(cur, prompt.anchor)
        return prompt

    def _select_context(self, cur: Cursor, anchor: int) -> None:
        """Choose chunks of other open files for `cur.uri` in the background; once chosen, prefill
        the new prompt at batch priority and only then switch to it, so no request pays for it."""
        s = self.settings
        if s.context_chunks <= 0 or cur.uri in self._selecting or len(self.docs) < 2:
            return
        self._selecting.add(cur.uri)
        spec = self.spec()
        rt = self.engine.rt

        def embed(texts):
            # cancelled between small packs once the editor is gone
            return rt.embed(texts, model=spec, priority=PRIORITY_BATCH, cancelled=lambda: self.closed)

        embed.model_key = spec.path

        def work():
            picked = self.index.select(embed, cur.uri, cur.prefix[-2000:], s.context_chunks,
                                       s.max_chunk_similarity, s.chunk_tokens)
            block = render_block(picked, cur.language_id)
            files = sorted({c.uri for c, _ in picked})
            if block and block != self.context.get(cur.uri, ("",))[0] and not self.closed:
                m = rt.load(spec)
                b = self.engine.builder(m)
                p = b.build(cur, anchor=anchor, context_block=block, budget=s.context_tokens,
                            suffix_tokens=s.suffix_tokens, use_fim=self.use_fim(b))
                stream = rt.submit(p.sent, model=spec, max_tokens=1,
                                   sampling=preset("greedy"), priority=PRIORITY_BATCH,
                                   confidence=ConfidenceConfig(enabled=False))
                self._background.add(stream)
                res, _ = _wait_stream(stream)
                self._background.discard(stream)
                if res is not None:
                    self.engine.stats.count("prewarm_tokens", res.n_prompt_tokens - res.n_cached_prompt_tokens)
            return block, files

        def done(f):
            self._selecting.discard(cur.uri)
            if f.cancelled() or f.exception() is not None or self.closed:
                if not f.cancelled() and f.exception() is not None:
                    log.info("context selection failed: %s", f.exception())
                return
            block, files = f.result()
            if block and cur.uri in self.docs:
                self.context[cur.uri] = (block, files)
                self.engine.stats.count("context_selections")

        fut = asyncio.get_running_loop().run_in_executor(self.engine.background, work)
        self._tasks.add(fut)
        fut.add_done_callback(lambda f: (self._tasks.discard(f), done(f)))

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """The connection is gone: stop its generation and forget its documents."""
        if self.closed:
            return
        self.closed = True   # context selection stops embedding at its next pack
        if self.gen is not None:
            self.gen.cancel("client disconnected")
        if self._warm_timer is not None:
            self._warm_timer.cancel()
        for stream in list(self._background):
            stream.cancel("client disconnected")
        self.latest += 1
        self.docs.clear()
        self.engine.sessions.discard(self)
