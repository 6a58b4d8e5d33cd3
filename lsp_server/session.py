"""One editor connection's state: its documents, settings and model, and the parts that use them.

A Session holds the open documents and the settings (and so the model) of one connection, and
composes what works over them, giving each what it reads: the completions (completion.py,
`Completer`) and the prompts kept stable and read ahead in the background (prompts.py, `Prompts`).
What every connection of a process shares is the Engine (engine.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..runtime.errors import A3BError
from . import config as cfg
from .completion import Answer, Completer
from .documents import Document, open_document
from .engine import Engine
from .prompts import Prompts

__all__ = ["Engine", "Session"]

log = logging.getLogger("a3b.lsp")


class Session:
    """One editor connection: its documents, settings and model; its completions and prompts."""

    def __init__(self, engine: Engine, notify: Callable[[str, str], None] | None = None):
        self.engine = engine
        self.settings = cfg.Settings()
        self.docs: dict[str, Document] = {}
        self.encoding = "utf-16"
        self._spec = None
        self.closed = False
        self.prompts = Prompts(engine, self.docs, lambda: self.settings, self.spec, self.model_if_loaded,
                               lambda: self.completer.running())
        self.completer = Completer(engine, self.docs, lambda: self.settings, lambda: self.encoding, self.model,
                                   self.spec, self.prompts.prompt, notify or (lambda level, msg: None))
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
                self.prompts.forget()
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
        return open_document(self.docs, uri)

    def open(self, uri: str, text: str, version: int, language_id: str) -> None:
        self.docs[uri] = Document(uri, text, version, language_id)
        self.prompts.set_document(uri, text)

    def change(self, uri: str, version: int, changes: list) -> None:
        d = self.doc(uri)
        where = None
        for ch in changes:
            where = d.apply(ch, self.encoding)
        d.version = version
        self.prompts.set_document(uri, d.snapshot())   # joined only if indexed
        if where is not None:
            self.prompts.hint(uri, where)   # the user is typing here
        self.completer.edited(uri, d)

    def close_doc(self, uri: str) -> None:
        self.docs.pop(uri, None)
        self.prompts.set_document(uri, None)

    # -- what the features ask -----------------------------------------------------------------
    async def complete(self, uri: str, position, progress=None) -> Answer:
        """A completion at `position` of `uri` (completion.py)."""
        return await self.completer.complete(uri, position, progress)

    def hint_position(self, uri: str, position) -> None:
        """The editor's cursor rests at `position` of `uri` (`a3b/cursor`): warm the prompt there."""
        d = self.docs.get(uri)
        if d is not None:
            self.prompts.hint(uri, d.offset_at(position, self.encoding, "cursor"))

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """The connection is gone: stop its generation and background work, and forget its documents."""
        if self.closed:
            return
        self.closed = True
        self.prompts.close()     # context selection stops embedding at its next pack
        self.completer.close()
        self.docs.clear()
        self.engine.sessions.discard(self)
