"""From the runtime's worker thread to the event loop: a GenerationStream's token events handed
into an inbox on the loop, the watch that cancels the stream when its client leaves or its time
runs out, and a streaming answer sent as server-sent events.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request

from ..runtime.errors import A3BError, Cancelled
from ..runtime.generation import GenerationResult
from ..runtime.stream import GenerationStream
from . import answers
from .chatout import ChatOutput
from .disconnect import on_disconnect


class Inbox:
    """Items handed over from the worker thread (with loop.call_soon_threadsafe) to the event loop:
    a deque and an event, so that a streaming answer sends every ready token in one write and waits
    only when there is nothing to send."""

    def __init__(self):
        self.items: collections.deque = collections.deque()
        self._ready = asyncio.Event()

    def put(self, item) -> None:
        self.items.append(item)
        self._ready.set()

    async def wait(self) -> None:
        """Until an item is there (the stream's end always puts one)."""
        while not self.items:
            self._ready.clear()
            await self._ready.wait()

    async def get(self):
        await self.wait()
        return self.items.popleft()


class Handover:
    """Items from the worker thread to the inboxes of one event loop, many at a time: the first item
    after a delivery schedules one (loop.call_soon_threadsafe, a wake-up of the loop through its
    self-pipe), and everything put until it runs goes with it. A decode step of 16 streaming requests
    hands its 16 tokens over in one wake-up instead of 16."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Inbox, object]] = []
        self.wakeups = 0

    def put(self, inbox: Inbox, item) -> None:
        with self._lock:
            self._items.append((inbox, item))
            if len(self._items) > 1:
                return   # a delivery is scheduled and has not run yet: it takes this item too
            self.wakeups += 1
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:   # the server's loop has stopped: the request is cancelled
            with self._lock:
                self._items.clear()
            raise Cancelled("server stopped") from None

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for inbox, item in items:
            inbox.put(item)


_handovers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Handover] = weakref.WeakKeyDictionary()


def handover(loop: asyncio.AbstractEventLoop) -> Handover:
    """The loop's Handover (made on the loop's own thread, at a request's start)."""
    h = _handovers.get(loop)
    if h is None:
        h = _handovers[loop] = Handover(loop)
    return h


async def start(submit: Callable[..., GenerationStream], request: Request | None = None,
                abandoned: threading.Event | None = None) -> tuple[GenerationStream, Inbox]:
    """Submit on an executor thread (it may load the model, or compile a grammar); token events and
    the end arrive in an inbox on this loop (None marks the end), handed over with those of every
    other stream. With `request` and `abandoned`, the client leaving meanwhile sets `abandoned` (the
    submit stops waiting for its grammar and raises Cancelled)."""
    loop = asyncio.get_running_loop()
    q = Inbox()
    h = handover(loop)

    def put(item):
        h.put(q, item)

    job = loop.run_in_executor(None, lambda: submit(put))
    if request is None or abandoned is None:
        stream = await job
    else:
        async with on_disconnect(request, abandoned.set):
            stream = await job
        if abandoned.is_set():   # the client left while it was submitted: the watch below would not see it
            stream.cancel("client disconnected")
    stream.add_done_callback(lambda s: put(None))
    return stream, q


@contextlib.asynccontextmanager
async def watched(request: Request, stream: GenerationStream, deadline_s: float | None,
                  stats: dict[str, int]) -> AsyncIterator[None]:
    """While the block runs, the client leaving cancels the stream at once (between two tokens
    in the scheduler), and so does the end of `deadline_s` (llama-server's t_max_predict_ms)."""
    left = False

    def gone() -> None:
        nonlocal left
        if not left and not stream.done:
            left = True
            stats["disconnects"] += 1
            stream.cancel("client disconnected")

    timer = (asyncio.get_running_loop().call_later(deadline_s, stream.cancel, "time limit")
             if deadline_s else None)
    try:
        async with on_disconnect(request, gone):
            yield
    finally:
        if timer is not None:
            timer.cancel()
        gone()   # still running: the client left, or the server stops (this task was cancelled)


def result(stream: GenerationStream) -> GenerationResult:
    """The ended stream's result; one cut by its time limit is an answer of finish_reason "length"."""
    try:
        return stream.result(0)
    except Cancelled as e:
        part = getattr(e, "partial", None)
        if part is not None and stream.cancel_reason == "time limit":
            part.finish_reason = "length"
            return part
        raise


async def sse(request: Request, stream: GenerationStream, q: Inbox, kind: str, rid: str, include_usage: bool,
              deadline_s: float | None, shape: ChatOutput | None, model_id: str, stats: dict[str, int]
              ) -> AsyncIterator[bytes]:
    """The stream's answer as server-sent events: every token ready goes out in one write."""
    created = int(time.time())
    offset = 0

    def chunk(*args, **kw) -> dict:
        return answers.chunk(kind, model_id, rid, created, *args, **kw)

    event = answers.event
    async with watched(request, stream, deadline_s, stats):
        if kind == "chat":
            yield event(chunk({"role": "assistant", "content": ""}))
        ended = False
        while not ended:
            await q.wait()
            out = b""
            while q.items:   # everything that is ready goes out in one write
                ev = q.items.popleft()
                if ev is None:
                    ended = True
                    break
                if shape is not None:
                    out += b"".join(event(chunk(d, ev if "content" in d else None)) for d in shape.deltas(ev))
                elif ev.text or ev.piece is not None:
                    out += event(chunk(ev.text, ev, offset))
                    offset += len(ev.text)
            if out:
                yield out
        try:
            res = result(stream)
        except A3BError as e:
            stats["errors"] += 1
            yield event({"error": {"message": str(e), "type": "server_error", "code": e.code}})
            return
        finish = res.finish_reason
        if shape is not None:
            yield b"".join(event(chunk(d)) for d in shape.last_deltas())
            finish = shape.finish(finish)
        final = chunk("" if kind != "chat" else {}, None, offset, finish)
        if kind == "infill":
            final.update(answers.infill_tail(res))
        extra = {**(shape.extra(res) if shape is not None else {}), **({"context_full": True} if res.context_full
                                                                           else {})}
        if extra:
            final["a3b"] = extra
        yield event(final)
        if include_usage:
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            yield event({"id": rid, "object": obj, "created": created, "model": model_id, "choices": [],
                         "usage": answers.usage(res)})
        if kind != "infill":
            yield b"data: [DONE]\n\n"
