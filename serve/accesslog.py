"""One line per request `a3b serve` answers: who, what, the status, the bytes sent and the time taken.

Plain ASGI around the whole application (refused requests are logged too, streamed answers when
they end), on the logger `a3b.serve.access` at INFO. `a3b serve --quiet` leaves it out.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("a3b.serve.access")

#: Longest request path written (a path is the client's to choose).
MAX_PATH = 200


class AccessLog:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status: int | None = None
        sent = 0

        async def send_counted(message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            client = scope.get("client")
            path = scope.get("path", "")
            path = (path[:MAX_PATH] + "..." if len(path) > MAX_PATH else path).encode("unicode_escape").decode()
            log.info('%s "%s %s" %s %d B %.3f s', f"{client[0]}:{client[1]}" if client else "-",
                     scope.get("method", "?"), path, status if status is not None else "-", sent,
                     time.perf_counter() - t0)
