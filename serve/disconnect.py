"""Noticing at once that an HTTP client went away, whatever its request is doing.

Once a request's body is read, the next message on its ASGI receive channel is `http.disconnect`:
the server sends it the moment the connection closes (uvicorn does so from `connection_lost`). A
task that awaits it beside the work turns a closed connection into a cancel within moments, while
tokens are flowing as well as between them, streamed or not, instead of a poll that only looks
after a quiet spell.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request


@contextlib.asynccontextmanager
async def on_disconnect(request: Request, callback: Callable[[], None]) -> AsyncIterator[None]:
    """Call `callback()` (on this loop) if the client disconnects while the block runs.

    Only for use after the body has been read: a body message that arrived meanwhile would be lost.
    The watch ends with the block, before the response is sent (the end of a response also wakes
    the receive channel, with a disconnect message that is no client's doing).
    """
    receive = request.receive

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        callback()

    task = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    finally:
        task.cancel()
