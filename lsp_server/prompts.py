"""The prompts of a connection's completions, kept stable and read ahead of the requests.

* A file's window keeps its anchor while the cursor stays in it, so the prompt's start (and its KV
  cache) stays the same from one request to the next.
* A new window starts choosing chunks of other open files for it in the background (context.py);
  once chosen, the new prompt is read at batch priority and only then used, so no request pays
  for it.
* Warming: where the cursor rests, the prompt a completion there would use is read at batch
  priority, so the first request costs what later ones do: only its last few tokens are new
  (llama.vim warms its cache the same way when the cursor rests).

`Prompts` gets what it reads from its connection's Session as arguments: the engine, the open
documents, and getters of the settings, the model and whether a completion is running.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ..runtime import PRIORITY_BATCH, ConfidenceConfig, preset
from ..runtime.errors import A3BError
from .config import Settings
from .context import ContextIndex, render_block
from .documents import Cursor, Document, DocumentError
from .engine import Engine
from .prompt import PromptBuilder

log = logging.getLogger("a3b.lsp")


def use_fim(settings: Settings, builder: PromptBuilder) -> bool:
    """Whether a prompt is fill-in-the-middle: the setting allows it and the model has FIM tokens."""
    return settings.fim != "off" and builder.fim is not None


def wait_stream(stream):
    """(result, None) or (None, the error) of a runtime stream, waited for on this thread."""
    try:
        return stream.result(), None
    except Exception as e:  # noqa: BLE001 - the caller gets any failure back; Cancelled carries .partial
        return None, e


class Prompts:
    """Prompt anchors, chosen context and warming of one connection."""

    WARM_PAUSE_S = 0.3

    def __init__(self, engine: Engine, docs: dict[str, Document], settings: Callable[[], Settings],
                 spec: Callable[[], Any], loaded: Callable[[], Any], busy: Callable[[], bool]):
        """`settings()` the connection's settings, `spec()` its model's LoadSpec, `loaded()` its
        model if loaded (else None), `busy()` whether a completion is running (it reads its own prompt)."""
        self.engine = engine
        self.docs = docs
        self.settings = settings
        self.spec = spec
        self.loaded = loaded
        self.busy = busy
        self.index = ContextIndex(engine.vectors)
        self.anchors: dict[str, int] = {}
        self.context: dict[str, tuple[str, list[str]]] = {}     # uri -> (prompt head, files)
        self.closed = False
        self._selecting: set[str] = set()
        self._tasks: set[asyncio.Future] = set()
        self._background: set = set()          # streams of prompts read at batch priority
        self._warm_timer: asyncio.TimerHandle | None = None

    # -- documents -----------------------------------------------------------------------------
    def set_document(self, uri: str, text) -> None:
        """The text of `uri` changed (None: closed); its chunks are indexed again when asked for."""
        self.index.set_document(uri, text, self.settings().chunk_tokens if text is not None else 0)
        if text is None:
            self.anchors.pop(uri, None)
            self.context.pop(uri, None)

    def forget(self) -> None:
        """The model changed: every anchor and chosen context is stale."""
        self.anchors.clear()
        self.context.clear()

    # -- the prompt ----------------------------------------------------------------------------
    def prompt(self, builder: PromptBuilder, cur: Cursor, fim: bool):
        """The prompt for `cur`, from the file's window at its anchor and the context chosen for it."""
        s = self.settings()
        head, files = self.context.get(cur.uri, ("", []))
        prev = self.anchors.get(cur.uri)
        prompt = builder.build(cur, anchor=prev, context_block=head, budget=s.context_tokens,
                               suffix_tokens=s.suffix_tokens, use_fim=fim, context_files=files)
        if prompt.anchor != prev:
            self.anchors[cur.uri] = prompt.anchor
            self._select_context(cur, prompt.anchor)
        return prompt

    def _select_context(self, cur: Cursor, anchor: int) -> None:
        """Choose chunks of other open files for `cur.uri` in the background; once chosen, prefill
        the new prompt at batch priority and only then switch to it, so no request pays for it."""
        s = self.settings()
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
                            suffix_tokens=s.suffix_tokens, use_fim=use_fim(s, b))
                stream = self._read_ahead(p.sent, spec)
                self._background.add(stream)
                res, _ = wait_stream(stream)
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

    def _read_ahead(self, sent, spec):
        """Read a prompt at batch priority (one greedy token, no confidence): its KV cache is then ready."""
        return self.engine.rt.submit(sent, model=spec, max_tokens=1, sampling=preset("greedy"),
                                     priority=PRIORITY_BATCH, confidence=ConfidenceConfig(enabled=False))

    # -- warming -------------------------------------------------------------------------------
    def hint(self, uri: str, offset: int) -> None:
        """The user's cursor is at `offset` of `uri` (an edit just happened there, or the editor said so
        with `a3b/cursor`). After a short pause, read the prompt a completion there would use."""
        if self.closed or not self.settings().warm:
            return
        if self._warm_timer is not None:
            self._warm_timer.cancel()
        self._warm_timer = asyncio.get_running_loop().call_later(self.WARM_PAUSE_S, self._warm, uri, offset)

    def _warm(self, uri: str, offset: int) -> None:
        self._warm_timer = None
        d = self.docs.get(uri)
        m = self.loaded()
        if d is None or m is None or self.closed or self.busy():
            return   # a running completion reads its own prompt
        try:
            d.check_usable(self.settings().max_document_bytes)
            cur = d.cursor_at(min(offset, len(d)))
        except DocumentError:
            return
        builder = self.engine.builder(m)
        try:
            prompt = self.prompt(builder, cur, use_fim(self.settings(), builder))
            stream = self._read_ahead(prompt.sent, self.spec())
        except A3BError as e:   # unloaded meanwhile, say: warming is a hint, never an error
            log.debug("warming skipped: %s", e)
            return
        self._track_background(stream, "warmed_tokens")

    def _track_background(self, stream, counter: str) -> None:
        """Count what a background prefill read; forget it when done; cancel it if the session ends."""
        self._background.add(stream)

        def wait():
            res, _ = wait_stream(stream)
            self._background.discard(stream)
            if res is not None:
                self.engine.stats.count(counter, res.n_prompt_tokens - res.n_cached_prompt_tokens)

        self.engine.background.submit(wait)

    def close(self) -> None:
        """The connection is gone: stop warming, choosing context (at its next pack) and reading ahead."""
        self.closed = True
        if self._warm_timer is not None:
            self._warm_timer.cancel()
        for stream in list(self._background):
            stream.cancel("client disconnected")
