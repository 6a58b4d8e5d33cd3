"""Completion logic of a connection: cache, joining a running generation, or a new one.

A request goes through these steps, cheapest first:

1. the cache (exact or typed-ahead hit) answers without the model;
2. a generation still running for the same spot, whose text so far agrees with what the user has
   typed since, is joined instead of started again;
3. otherwise the previous generation of this connection is cancelled ("latest request wins": it
   stops between two tokens), the request waits `debounce_ms`, gives up if a newer request or an
   edit arrived meanwhile, and runs the model at interactive priority.

Edits cancel a running generation unless they type exactly what it is generating; $/cancelRequest
cancels it unless such an edit keeps it useful. A closed connection cancels everything it started.

`Completer` holds a connection's running generation; what it reads (the engine, the open documents,
the settings, the model, the prompts) it gets from the connection's Session (session.py) as
constructor arguments.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..runtime import PRIORITY_INTERACTIVE, ConfidenceConfig, preset
from ..runtime.errors import Cancelled, ModelUnloaded
from .cache import bucket_key
from .config import Settings
from .documents import Cursor, Document, open_document
from .engine import Engine
from .postprocess import block_end, finish, healed
from .prompt import PromptBuilder, is_multiline
from .prompts import use_fim, wait_stream

log = logging.getLogger("a3b.lsp")

#: How completions are sampled: the "code" preset without its repeat penalty. Code repeats its own
#: names from line to line (`self._dict`, `state.bMarks[startLine]`), and a penalty on the last 64
#: tokens pushes the model off exactly those: on 400 held-out lines of each of two packages, through
#: this path (bench/nextline.py, the embedded model), the line came out right at 39 instead of 36
#: (markdown_it) and 30 instead of 24 (httpx) without it, 48 instead of 45 with a tuned adapter.
#: Greedy decoding was not better everywhere (44 and 24). A suggestion is short and ends at a run of
#: blank lines, which bounds the loops a penalty guards long generations against.
SAMPLING = preset("code", seed=0, repeat_penalty=1.0)


@dataclass
class Answer:
    text: str                       # "" = nothing to suggest
    cursor: Cursor
    source: str                     # cache_exact, cache_typed, join, model, superseded, stale, empty
    multiline: bool
    spans: list = field(default_factory=list)   # low-confidence spans inside `text`
    latency: float = 0.0


class Gen:
    """One running generation and what is needed to decide whether a new request can join it."""

    def __init__(self, cur: Cursor, key: str, multiline: bool, doc_len: int, heal: str = ""):
        self.cur = cur
        self.key = key
        self.multiline = multiline
        self.doc_len = doc_len
        self.heal = heal                # what the model writes first and the cursor already has (codeheader.heal_split)
        self.raw: str | None = ""       # the model's text until it has got past the heal, then None
        self.text = ""
        self.stream = None
        self.waiters = 0
        self.keep_alive = False
        self.done = asyncio.get_running_loop().create_future()
        self.suggestion = ""
        self.spans: list = []
        self.cancel_reason: str | None = None

    def on_token(self, ev) -> None:  # scheduler thread
        if self.raw is None:            # past the heal: the text grows by what each token adds
            self.text += ev.text
        else:
            self.raw += ev.text
            text = healed(self.raw, self.heal)
            if text is None:
                self.stream.cancel("heal mismatch")  # it writes elsewhere than at the cursor: nothing to show
                return
            if len(self.raw) >= len(self.heal):
                self.raw = None
            self.text = text
        if self.multiline and "\n" in ev.text and block_end(self.text, self.cur) is not None:
            self.stream.cancel("block end")  # the rest would be cut anyway: stop decoding it

    def cancel(self, reason: str) -> None:
        if self.stream is not None and not self.done.done():
            self.cancel_reason = reason
            self.stream.cancel(reason)

    def agrees(self, typed: str) -> bool:
        """The user typed exactly what this generation has produced so far (or nothing)."""
        return self.text.startswith(typed)

    def joinable(self, key: str, cur: Cursor) -> bool:
        if key != self.key or self.done.done() and not self.suggestion:
            return False
        n = cur.offset - self.cur.offset
        if n < 0 or cur.uri != self.cur.uri:
            return False
        typed = cur.prefix[len(cur.prefix) - n:] if n else ""
        tail = self.cur.prefix[-400:]
        return cur.prefix.endswith(tail, 0, len(cur.prefix) - n) and self.agrees(typed)


class Completer:
    """The completions of one connection: at most one running generation, and the requests that wait
    for it, join it or supersede it."""

    def __init__(self, engine: Engine, docs: dict[str, Document], settings: Callable[[], Settings],
                 encoding: Callable[[], str], model: Callable[[Any], Awaitable[Any]], spec: Callable[[], Any],
                 prompt: Callable[[PromptBuilder, Cursor, bool], Any],
                 notify: Callable[[str, str], None] = lambda level, msg: None):
        """`engine` the shared runtime, cache and statistics; `docs` the connection's open documents;
        `settings()` and `encoding()` its settings and position encoding; `await model(progress)` its
        model (loaded if need be), `spec()` its LoadSpec; `prompt(builder, cursor, fim)` the prompt
        at a cursor (prompts.py); `notify(level, message)` tells the user of a failed generation."""
        self.engine = engine
        self.docs = docs
        self.settings = settings
        self.encoding = encoding
        self.model = model
        self.spec = spec
        self.prompt = prompt
        self.notify = notify
        self.gen: Gen | None = None
        self.latest = 0

    def running(self) -> bool:
        return self.gen is not None and not self.gen.done.done()

    # -- edits during a generation -------------------------------------------------------------
    def edited(self, uri: str, d: Document) -> None:
        """`d` (`uri`) was edited: the running generation there goes on if the user typed what it
        is writing, and is cancelled otherwise."""
        g = self.gen
        if g is not None and not g.done.done() and g.cur.uri == uri:
            if self._typed_ahead(g, d):
                g.keep_alive = True
            else:
                g.cancel("document changed")
                self.engine.stats.count("cancelled_by_edit")

    def close(self) -> None:
        """The connection is gone: stop its generation; requests still waiting answer "superseded"."""
        if self.gen is not None:
            self.gen.cancel("client disconnected")
        self.latest += 1

    @staticmethod
    def _typed_ahead(g: Gen, d: Document) -> bool:
        """Did the edits only insert, at the generation's cursor, text it agrees with?"""
        dx = len(d) - g.doc_len
        off = g.cur.offset
        if dx < 0:
            return False
        head, tail = g.cur.suffix[:200], g.cur.prefix[-400:]
        if d.slice(off + dx, off + dx + len(head)) != head or d.slice(off - len(tail), off) != tail:
            return False
        return g.agrees(d.slice(off, off + dx))

    # -- completion ----------------------------------------------------------------------------
    def cache_key(self, m, cur: Cursor, multiline: bool, fim: bool) -> str:
        # the single/multi-line mode is not part of the key: it follows from the same context, and a
        # suggestion typed into stays valid when the mode at the new position differs
        return bucket_key(m.info.path, str(id(m.info)), cur.uri, "fim" if fim else "pre",
                          cur.line_suffix, cur.suffix[:240])

    async def complete(self, uri: str, position, progress=None) -> Answer:
        """A completion at `position`; once more if the model is unloaded under it (ComfyUI's
        "Unload models" while the prompt is built): the second attempt loads it again."""
        try:
            return await self._complete(uri, position, progress)
        except ModelUnloaded:
            self.engine.stats.count("retried_after_unload")
            return await self._complete(uri, position, progress)

    async def _complete(self, uri: str, position, progress=None) -> Answer:
        t0 = time.perf_counter()
        st = self.engine.stats
        st.count("requests")
        settings = self.settings()
        d = open_document(self.docs, uri)
        d.check_usable(settings.max_document_bytes)
        cur = d.cursor(position, self.encoding())
        m = await self.model(progress)
        builder = self.engine.builder(m)
        fim = use_fim(self.settings(), builder)
        multiline = is_multiline(cur)
        key = self.cache_key(m, cur, multiline, fim)

        def answer(text: str, source: str, spans=None) -> Answer:
            a = Answer(text, cur, source, multiline, spans or [], time.perf_counter() - t0)
            if source in ("superseded", "stale"):
                st.count(f"dropped_{source}")
            else:
                st.answered(a.latency, source, multiline)
            return a

        hit = self.engine.cache.get(key, cur.prefix)
        if hit is not None:
            return answer(hit[1], "cache_" + hit[0])
        self.latest += 1
        me = self.latest
        g = self.gen
        if g is not None and not g.done.done():
            if g.joinable(key, cur):
                st.count("joined")
                res = await self._wait(g)
                if res is not None:
                    hit = self.engine.cache.get(key, cur.prefix, count=False)
                    return answer(hit[1] if hit else "", "join")
            else:
                g.cancel("superseded")
                st.count("cancelled_superseded")
        debounce_ms = self.settings().debounce_ms
        if debounce_ms:
            await asyncio.sleep(debounce_ms / 1000.0)
        if self.latest != me:
            return answer("", "superseded")
        if d.version != cur.version or self.docs.get(uri) is not d:
            return answer("", "stale")
        hit = self.engine.cache.get(key, cur.prefix, count=False)
        if hit is not None:
            return answer(hit[1], "cache_" + hit[0])
        g = self._start(m, builder, cur, key, multiline, fim, len(d))
        res = await self._wait(g)
        if res is None:
            return answer("", "superseded")
        hit = self.engine.cache.get(key, cur.prefix, count=False)
        text = hit[1] if hit else ""
        spans = g.spans if text == g.suggestion else []
        return answer(text, "model" if text else "empty", spans)

    async def _wait(self, g: Gen):
        """Wait for `g`; None if it was cancelled. A cancelled request ($/cancelRequest, closed
        connection) stops the generation unless another request or a typed-ahead edit needs it."""
        g.waiters += 1
        try:
            return await asyncio.shield(g.done)
        except asyncio.CancelledError:
            if g.waiters <= 1 and not g.keep_alive:
                g.cancel("request cancelled")
                self.engine.stats.count("cancelled_by_client")
            raise
        finally:
            g.waiters -= 1

    def _start(self, m, builder: PromptBuilder, cur: Cursor, key: str, multiline: bool, fim: bool,
               doc_len: int) -> Gen:
        s = self.settings()
        prompt = self.prompt(builder, cur, fim)
        self.engine.stats.count(f"prompts_{prompt.mode}")
        g = Gen(cur, key, multiline, doc_len, prompt.heal)
        loop = asyncio.get_running_loop()
        max_tokens = s.max_tokens if multiline else min(s.max_tokens, s.max_tokens_single_line)
        stop = ["\n\n\n"] if multiline else ["\n"]
        g.stream = self.engine.rt.submit(
            prompt.sent, model=self.spec(), max_tokens=max_tokens,
            sampling=SAMPLING, stop=stop, grammar=prompt.grammar, priority=PRIORITY_INTERACTIVE,
            thinking="off",
            confidence=ConfidenceConfig(enabled=True, threshold=s.confidence_threshold),
            speculative=s.speculative, on_token=g.on_token)
        self.gen = g
        self.engine.stats.count("generations")
        fut = loop.run_in_executor(self.engine.executor, wait_stream, g.stream)
        fut.add_done_callback(lambda f: self._finished(g, f, prompt))
        return g

    def _finished(self, g: Gen, fut: asyncio.Future, prompt) -> None:
        st = self.engine.stats
        res, err = fut.result() if not fut.cancelled() else (None, Cancelled("executor stopped"))
        if err is not None and g.cancel_reason is None and getattr(g.stream, "cancel_reason", "") in (
                "block end", "heal mismatch"):
            res, err = getattr(err, "partial", None), None
        if res is not None:
            st.count("prompt_tokens", res.n_prompt_tokens)
            st.count("cached_prompt_tokens", res.n_cached_prompt_tokens)
            st.count("generated_tokens", res.n_tokens)
        if err is not None or res is None:
            partial = getattr(err, "partial", None)
            if partial is not None:
                st.count("wasted_generated_tokens", partial.n_tokens)
                if partial.n_tokens:
                    st.count("wasted_prompt_tokens", partial.n_prompt_tokens - partial.n_cached_prompt_tokens)
            st.count("generations_cancelled" if isinstance(err, Cancelled) else "generations_failed")
            if not isinstance(err, Cancelled):
                log.warning("completion failed: %s", err)
                self.notify("error", f"A3B completion failed: {err}")
            if not g.done.done():
                g.done.set_result(None)
            return
        st.count("prefill_tokens", res.n_prompt_tokens - res.n_cached_prompt_tokens)
        text = healed(res.text, g.heal)
        g.suggestion = finish(text, g.cur, g.multiline) if text else ""
        g.spans = _spans_in(res.spans, g.suggestion)
        self.engine.cache.put(g.key, g.cur.prefix, g.suggestion)
        if g.waiters == 0:
            st.count("wasted_generated_tokens", res.n_tokens)   # nobody waits for it any more
            st.count("unused_generations")
        else:
            st.count("useful_decode_tokens", res.n_prompt_tokens - res.n_cached_prompt_tokens + res.n_tokens)
        if not g.done.done():
            g.done.set_result(res)


def _spans_in(spans, text: str) -> list[tuple[int, int, float]]:
    """Low-confidence spans of the raw text, located in the final suggestion (start, end, entropy)."""
    out = []
    for sp in spans:
        t = sp.text.strip()
        i = text.find(t) if t else -1
        if i >= 0:
            out.append((i, i + len(t), sp.mean_entropy))
    return out
