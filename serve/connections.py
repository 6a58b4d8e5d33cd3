"""Bounds on the connections `a3b serve` holds: how many at once, and how long one may send no request.

uvicorn closes a connection that stays idle between two requests (its keep-alive timeout), but it
keeps one that never completes a request for as long as the client likes, and it accepts connections
until the process has no file descriptors left, when every request of every client fails and asyncio
logs a traceback per attempt to accept. Inside ComfyUI that is someone else's process. So:

* past `max_connections` open connections, a new one is answered 503 and closed at once;
* a connection that has not started a request within `header_timeout` seconds of opening (or of
  its last answer) is closed;
* each overload (too many connections, or no file descriptor left) is logged at most once a minute,
  never per connection.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger("a3b.serve")

#: Connections served at once (an editor or a chat front end holds a few).
MAX_CONNECTIONS = 64
#: Seconds a connection may stay open without starting a request.
HEADER_TIMEOUT_S = 10.0
#: Seconds an idle keep-alive connection is kept after an answer (uvicorn's own timer).
KEEP_ALIVE_S = 5

_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_BUSY = object()   # a connection's state at a check while it serves a request


def _busy_answer(limit: int) -> bytes:
    body = json.dumps({"error": {"message": f"Too many connections: this server keeps {limit} at once; "
                                            "try again in a moment.", "type": "server_error",
                                 "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\nretry-after: 1\r\n\r\n%s" % (len(body), body))


class _Note:
    """A condition logged at most once a minute, saying how often it happened since the last line."""

    def __init__(self, interval: float = 60.0):
        self.interval = interval
        self._last = -interval
        self._since = 0

    def __call__(self, level: int, message: str, *args) -> None:
        self._since += 1
        now = time.monotonic()
        if now - self._last >= self.interval:
            more = f" ({self._since} times since the last note)" if self._since > 1 else ""
            log.log(level, message + more, *args)
            self._last, self._since = now, 0


class Overload:
    """The overload conditions of one server, each logged at most once a minute (it may come and go
    many times a second), never a line per connection."""

    def __init__(self, max_connections: int):
        self.max_connections = max_connections
        self.refused = 0            # connections answered 503 (in all)
        self._full = _Note()
        self._no_fds = _Note()

    def refuse(self) -> None:
        self.refused += 1
        self._full(logging.WARNING, "a3b serve: %d connections are open, the most it keeps; new ones get 503 "
                   "until some close", self.max_connections)

    def loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The server loop's exception handler: a failed accept() for want of file descriptors is
        one line (asyncio retries every second, with a traceback each time)."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_FDS and "accept" in str(context.get("message", "")):
            self._no_fds(logging.ERROR, "a3b serve: the process has no file descriptor left for new connections "
                         "(%s); they wait until some close (raise `ulimit -n`, or close what holds them)",
                         exc.strerror)
            return
        if isinstance(exc, ValueError) and "_start_serving" in repr(context.get("handle")):
            # asyncio's retry of such an accept() running after the server closed its socket
            log.debug("a3b serve: accept retry after shutdown: %s", exc)
            return
        loop.default_exception_handler(context)


def nodelay(transport) -> None:
    """Send each write at once (TCP_NODELAY). asyncio sets it only on sockets whose protocol number is
    TCP's, and a listening socket from `socket.create_server` (Server.bind) hands out sockets of
    protocol 0: there Nagle's algorithm held a stream's next small write until the client
    acknowledged the one before, which a client delays by up to 40 ms (measured: the first token of
    a stream reached the client 33 ms after the engine had it)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def protocol_class(overload: Overload, header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with the connection bounds above."""
    busy = _busy_answer(overload.max_connections)

    class BoundedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:   # type: ignore[override]
            nodelay(transport)
            super().connection_made(transport)
            if len(self.connections) > overload.max_connections:
                overload.refuse()
                transport.write(busy)
                transport.close()
                return
            self._a3b_idle_at = None   # the request it was idle after at the last check (None: none yet)
            self._a3b_timer = self.loop.call_later(header_timeout, self._a3b_check)

        def _a3b_check(self) -> None:
            """Close the connection if it was idle at the last check and still is, after the same
            request (or none yet): it has started no request for a whole period."""
            cycle = self.cycle
            idle = cycle is None or cycle.response_complete
            if idle and cycle is self._a3b_idle_at:
                self.transport.close()
                return
            self._a3b_idle_at = cycle if idle else _BUSY
            self._a3b_timer = self.loop.call_later(header_timeout, self._a3b_check)

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_a3b_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

    return BoundedHTTPProtocol


class UvicornServer(uvicorn.Server):
    """uvicorn's server, with the overload handler on its event loop."""

    def __init__(self, config: uvicorn.Config, overload: Overload):
        super().__init__(config)
        self.overload = overload

    async def startup(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(self.overload.loop_exception)
        await super().startup(sockets=sockets)
