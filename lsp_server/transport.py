"""Transports: stdio, TCP and WebSocket, each connection with its own server over one shared Engine.

What this adds to pygls' own loops:

* every connection gets its own protocol and workspace (a `Connection`, connection.py, which also
  answers the JSON-RPC errors pygls leaves unanswered), so several editors can share one process
  (and one loaded model) over TCP or WebSocket; `exit` closes only that connection;
* strict framing: only Content-Length / Content-Type headers, bounded sizes. One parser without I/O
  (FrameParser, framing.py) serves stdio and TCP: their readers only read bytes and feed it;
* security for TCP/WS: listening on loopback addresses only, refusing peers that are not loopback,
  refusing WebSocket handshakes that carry a browser Origin (a web page could otherwise reach a
  loopback port), and an optional token (initializationOptions.token, or for WebSocket also
  `?token=` or `Authorization: Bearer`) checked before anything else is served;
* limits: connections served at once, and how long a connection may stay silent.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable
from urllib.parse import parse_qs, urlparse

from ..runtime.environment import env_number
from ..runtime.netguard import is_loopback, origin_ok, token_ok
from .connection import Connection
from .engine import Engine
from .framing import MAX_MESSAGE_BYTES, FrameParser, FramingError, _frame

log = logging.getLogger("a3b.lsp")

READ_BYTES = 1 << 16                     # what one read of stdin or a socket asks for

#: TCP/WebSocket limits: connections served at once, seconds a new connection has to send
#: `initialize`, and seconds an initialized connection may stay silent (0 = no limit). An editor
#: that is merely idle sends nothing for a long while, hence the generous default.
MAX_CONNECTIONS = env_number("A3B_LSP_MAX_CLIENTS", int)
INIT_TIMEOUT_S = env_number("A3B_LSP_INIT_TIMEOUT_S")
IDLE_TIMEOUT_S = env_number("A3B_LSP_IDLE_TIMEOUT_S")


def parse_address(text: str) -> tuple[str, int]:
    """HOST:PORT (or [v6]:PORT) that must name a loopback address."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"Expected HOST:PORT, like 127.0.0.1:7011, got {text!r}.")
    host = host.strip("[]")
    if not is_loopback(host):
        raise ValueError(f"Refusing to listen on {host}: the language server only binds to loopback addresses "
                         "(127.0.0.1, ::1, localhost), so other machines cannot drive the model.")
    if int(port) > 65535:
        raise ValueError(f"Port {port} is out of range (0-65535).")
    return ("127.0.0.1" if host == "localhost" else host), int(port)


# -- stdio --------------------------------------------------------------------------------------
class FdReader:
    """Reads a raw file descriptor with os.read, for the stdin reader thread.

    Python's buffered stdin holds a lock while it blocks; a daemon thread blocked there makes the
    interpreter abort at exit. os.read holds nothing, so the reading thread can simply be abandoned.
    """

    def __init__(self, fd: int):
        self.fd = fd

    def read1(self, size: int) -> bytes:
        """At most `size` bytes, as soon as any are available; b"" at end of input."""
        return os.read(self.fd, size)


class _StdoutWriter:
    def __init__(self, out):
        self.out = out

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()

    def close(self) -> None:
        pass


async def serve_stdio(engine: Engine, stdin, stdout) -> int:
    """Serve one editor over stdin/stdout until `exit` or end of input. Returns the exit code.

    `stdin` is anything with `read1(size)` (an FdReader over the real stdin); `stdout` a binary file.
    End of input means the editor is gone: what it sent before and is still queued is dropped then
    (200 queued edits of a large file would otherwise keep a dead editor's server busy for
    minutes), except the small messages among it that end a session (`shutdown`, `exit`), which
    set the exit code.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stopped = asyncio.Event()
    ended = threading.Event()   # set by the reading thread at end of input, seen between two messages
    conn = Connection(engine, "stdio", _StdoutWriter(stdout), on_close=lambda: loop.call_soon_threadsafe(stopped.set))

    def deliver(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:   # the loop has closed: the server is shutting down
            pass

    def pump():  # a daemon thread: a blocked read never keeps the process alive
        parser = FrameParser()
        try:
            while chunk := stdin.read1(READ_BYTES):
                for body in parser.feed(chunk):
                    deliver(body)
        except FramingError as e:
            for body in e.messages:
                deliver(body)
            deliver(e)
        except Exception as e:  # noqa: BLE001 - a closed pipe, whatever the platform calls it
            log.info("stdin: %s", e)
        ended.set()
        deliver(None)

    threading.Thread(target=pump, name="a3b-lsp-stdin", daemon=True).start()
    dropped = 0
    while not conn.done:
        item = await queue.get()
        if item is None:
            break
        if isinstance(item, FramingError):
            conn.send_error(None, -32700, f"Parse error: {item} The stream cannot continue.")
            break
        if ended.is_set() and not _ends_session(item):
            dropped += 1
            continue
        conn.feed(item)
    if dropped:
        log.info("stdin closed: dropped %d queued messages", dropped)
    conn.close(conn.exit_code if conn.exit_code is not None else 1)
    await asyncio.sleep(0)  # let the last responses go out
    return conn.exit_code or 0


#: Messages at most this long are read after end of input, for a `shutdown` or `exit` among them.
SESSION_END_BYTES = 200


def _ends_session(body: bytes) -> bool:
    """A small `shutdown` request or `exit` notification (read without parsing anything large)."""
    if len(body) > SESSION_END_BYTES:
        return False
    try:
        return json.loads(body).get("method") in ("shutdown", "exit")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return False


# -- TCP ------------------------------------------------------------------------------------------
class Listener:
    """A running TCP or WebSocket listener (for the CLI and the in-process server)."""

    def __init__(self, kind: str, host: str, port: int):
        self.kind, self.host, self.port = kind, host, port
        self.server = None
        self.connections: set[Connection] = set()
        self.refused = 0

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.kind}://{host}:{self.port}"

    def close(self) -> None:
        for c in list(self.connections):
            c.close()
        if self.server is not None:
            self.server.close()


async def start_tcp(engine: Engine, host: str, port: int, token: str | None) -> Listener:
    lst = Listener("tcp", host, port)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        peer = writer.get_extra_info("peername") or ("?",)
        if not is_loopback(str(peer[0])):
            lst.refused += 1
            log.warning("refused a TCP connection from %s: only loopback clients are served", peer[0])
            writer.close()
            return
        if len(lst.connections) >= MAX_CONNECTIONS:
            lst.refused += 1
            log.warning("refused a TCP connection: %d editors are connected already (A3B_LSP_MAX_CLIENTS)",
                        len(lst.connections))
            writer.write(_frame({"jsonrpc": "2.0", "id": None, "error": {
                "code": -32000, "message": f"Too many connections: this A3B server serves {MAX_CONNECTIONS} "
                                           "editors at once (A3B_LSP_MAX_CLIENTS)."}}))
            await _drain_and_close(writer)
            return
        conn = Connection(engine, f"tcp {peer[0]}:{peer[1]}", writer, token=token,
                          on_close=lambda: writer.close())
        lst.connections.add(conn)
        parser = FrameParser()
        try:
            while not conn.done:
                chunk = await _read_within(reader.read(READ_BYTES), conn)
                if not chunk:
                    break
                for body in parser.feed(chunk):
                    conn.feed(body)         # ignored once the connection is done
        except FramingError as e:
            for body in e.messages:
                conn.feed(body)
            conn.send_error(None, -32700, f"Parse error: {e} Closing the connection.")
        except (ConnectionError, OSError):
            pass
        finally:
            conn.close()
            lst.connections.discard(conn)

    lst.server = await asyncio.start_server(handle, host, port)
    lst.port = lst.server.sockets[0].getsockname()[1]
    return lst


async def _drain_and_close(writer) -> None:
    try:
        await asyncio.wait_for(writer.drain(), 5)
    except (OSError, asyncio.TimeoutError):
        pass
    writer.close()


async def _read_within(read, conn: Connection):
    """`read`, or b"" (end of input) when the connection stays silent past its deadline."""
    limit = IDLE_TIMEOUT_S if conn.initialized else INIT_TIMEOUT_S
    try:
        return await (asyncio.wait_for(read, limit) if limit > 0 else read)
    except asyncio.TimeoutError:
        what = "sent nothing" if conn.initialized else "did not initialize"
        log.info("%s %s for %.0f s: closing it", conn.label, what, limit)
        return b""


# -- WebSocket ------------------------------------------------------------------------------------
class _WSWriter:
    """pygls' writer over a WebSocket: each message is sent by a task, kept until it is done."""

    def __init__(self, ws):
        self.ws = ws
        self.pending: set[asyncio.Task] = set()

    def write(self, data: bytes) -> None:
        task = asyncio.get_running_loop().create_task(self.ws.send(data.decode("utf-8")))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def flushed(self, timeout: float = 5.0) -> None:
        if self.pending:
            await asyncio.wait(list(self.pending), timeout=timeout)

    def close(self) -> None:
        pass


async def start_ws(engine: Engine, host: str, port: int, token: str | None) -> Listener:
    from websockets.asyncio.server import serve
    from websockets.exceptions import ConnectionClosed

    lst = Listener("ws", host, port)

    def check(connection, request):
        peer = (connection.remote_address or ("?",))[0]
        if not is_loopback(str(peer)):
            lst.refused += 1
            return connection.respond(403, "Only loopback clients are served.\n")
        if not origin_ok(request.headers.get("Origin")):
            lst.refused += 1
            return connection.respond(403, "Browser origins are refused: a web page must not drive the model.\n")
        given = parse_qs(urlparse(request.path).query).get("token", [None])[0]
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        if given is not None:
            if not token_ok(token, given):
                lst.refused += 1
                return connection.respond(401, "Wrong token.\n")
            connection.a3b_authorized = True
        return None

    async def handler(ws):
        peer = (ws.remote_address or ("?", "?"))
        if len(lst.connections) >= MAX_CONNECTIONS:
            lst.refused += 1
            await ws.close(1013, f"too many connections (A3B_LSP_MAX_CLIENTS={MAX_CONNECTIONS})")
            return
        writer = _WSWriter(ws)
        conn = Connection(engine, f"ws {peer[0]}:{peer[1]}", writer, include_headers=False, token=token,
                          authorized=getattr(ws, "a3b_authorized", False))
        lst.connections.add(conn)
        try:
            while not conn.done:
                message = await _read_within(ws.recv(), conn)
                if not message:
                    break
                conn.feed(message)
        except ConnectionClosed:
            pass
        finally:
            conn.close()
            lst.connections.discard(conn)
            await writer.flushed()   # an error sent just before closing (a wrong token) goes out first
            await ws.close()

    lst.server = await serve(handler, host, port, process_request=check, max_size=MAX_MESSAGE_BYTES,
                             ping_interval=None)
    lst.port = next(iter(lst.server.sockets)).getsockname()[1]
    return lst


async def serve_forever(engine: Engine, kind: str, host: str, port: int, token: str | None,
                        ready: Callable[[Listener], None] | None = None) -> None:
    lst = await (start_tcp if kind == "tcp" else start_ws)(engine, host, port, token)
    if ready:
        ready(lst)
    try:
        await lst.server.serve_forever()
    finally:
        lst.close()
