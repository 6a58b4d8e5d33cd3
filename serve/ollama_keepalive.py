"""Ollama's keep_alive over the runtime's model store: how long a model stays loaded once idle."""
from __future__ import annotations

import asyncio
import logging
import time

from ..runtime.options import LoadSpec

log = logging.getLogger("a3b.serve")


class KeepAlive:
    """Ollama's keep_alive over the model store: after a request, a model stays loaded for that long
    once idle, then is unloaded (0: at once; negative: until the store itself evicts it). A model
    still busy when its time comes is looked at again a second later. Runs on the server's loop."""

    def __init__(self, rt):
        self.rt = rt
        self.timers: dict[LoadSpec, asyncio.TimerHandle] = {}
        #: when each model will be unloaded (time.time()); None: kept
        self.expires: dict[LoadSpec, float | None] = {}

    def after(self, spec: LoadSpec, seconds: float | None) -> None:
        if seconds is None:
            return
        old = self.timers.pop(spec, None)
        if old is not None:
            old.cancel()
        if seconds < 0:
            self.expires[spec] = None
            return
        self.expires[spec] = time.time() + seconds
        self.timers[spec] = asyncio.get_running_loop().call_later(seconds, self._expire, spec)

    def _expire(self, spec: LoadSpec) -> None:
        self.timers.pop(spec, None)
        loop = asyncio.get_running_loop()
        m = self.rt.loaded(spec)
        if m is None:
            self.expires.pop(spec, None)
            return
        if m.busy():
            self.timers[spec] = loop.call_later(1.0, self._expire, spec)
            return
        self.expires.pop(spec, None)
        log.info("keep_alive over: unloading %s", spec.path)
        loop.run_in_executor(None, self.rt.unload, spec)


__all__ = ["KeepAlive"]
