"""Transports: stdio, TCP and WebSocket, each connection with its own server over one shared Engine.

What this adds to pygls' own loops:

* every connection gets its own protocol and workspace, so several editors can share one process
  (and one loaded model) over TCP or WebSocket; `exit` closes only that connection;
* JSON-RPC errors that pygls leaves unanswered: a body that is not JSON gets a Parse error (-32700),
  a message that is not a JSON-RPC 2.0 object an Invalid request (-32600), a request whose params do
  not match the LSP types an Invalid params (-32602) naming the field; all with the request's id when
  there is one, so a client never waits for an answer that will not come;
* strict framing: only Content-Length / Content-Type headers, bounded sizes. One parser without I/O
  (FrameParser, framing.py) serves stdio and TCP: their readers only read bytes and feed it;
* security for TCP/WS: listening on loopback addresses only, refusing peers that are not loopback,
  refusing WebSocket handshakes that carry a browser Origin (a web page could otherwise reach a
  loopback port), and an optional token (initializationOptions.token, or for WebSocket also
  `?token=` or `Authorization: Bearer`) checked before anything else is served.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable
from urllib.parse import parse_qs, urlparse

from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams

from ..runtime.environment import env_number
from ..runtime.netguard import is_loopback, origin_ok, token_ok
from .framing import MAX_MESSAGE_BYTES, FrameParser, FramingError, _frame
from .pygls_compat import awaits_reply, fail_request, pending_requests, send_raw
from .server import A3BServer
from .engine import Engine

log = logging.getLogger("a3b.lsp")

READ_BYTES = 1 << 16                     # what one read of stdin or a socket asks for
UNAUTHORIZED = -32001
SERVER_NOT_INITIALIZED = -32002
INVALID_REQUEST = -32600


#: TCP/WebSocket limits: connections served at once, seconds a new connection has to send
#: `initialize`, and seconds an initialized connection may stay silent (0 = no limit). An editor
#: that is merely idle sends nothing for a long while, hence the generous default.
MAX_CONNECTIONS = env_number("A3B_LSP_MAX_CLIENTS", int)
INIT_TIMEOUT_S = env_number("A3B_LSP_INIT_TIMEOUT_S")
IDLE_TIMEOUT_S = env_number("A3B_LSP_IDLE_TIMEOUT_S")


def _is_notification(method: str) -> bool:
    """An LSP notification (its spec defines no response), as opposed to a request."""
    from lsprotocol.types import METHOD_TO_TYPES

    types = METHOD_TO_TYPES.get(method)
    return types is not None and types[1] is None


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


class Connection:
    """One editor: a server object, its writer, and the JSON-RPC checks in front of pygls."""

    def __init__(self, engine: Engine, label: str, writer, *, include_headers: bool = True,
                 token: str | None = None, authorized: bool = False, on_close: Callable[[], None] | None = None):
        self.engine = engine
        self.label = label
        self.token = token
        self.authorized = authorized or token is None
        self.server = A3BServer(engine, self)
        self.server.protocol.set_writer(writer, include_headers)
        self.writer = writer
        self.done = False
        self.initialized = False           # `initialize` has been answered (or is being handled)
        self.exit_code: int | None = None
        self._on_close = on_close
        log.info("%s connected", label)

    def deadline(self) -> float:
        """Seconds this connection may stay silent before it is closed (0: no limit)."""
        return IDLE_TIMEOUT_S if self.initialized else INIT_TIMEOUT_S

    # -- incoming ------------------------------------------------------------------------------
    def send_error(self, msg_id, code: int, message: str) -> None:
        send_raw(self.server.protocol, {"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}})

    def feed(self, body: bytes | str) -> None:
        if self.done:
            return
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            self.send_error(None, -32700, f"Parse error: the message is not valid JSON ({e}).")
            return
        if isinstance(data, list):
            self.send_error(None, -32600, "Invalid request: JSON-RPC batches are not supported by LSP.")
            return
        if not isinstance(data, dict):
            self.send_error(None, -32600, f"Invalid request: expected a JSON object, got {type(data).__name__}.")
            return
        msg_id = data.get("id")
        if isinstance(msg_id, bool) or (msg_id is not None and not isinstance(msg_id, (int, str))):
            self.send_error(None, -32600, "Invalid request: 'id' must be a number or a string.")
            return
        method = data.get("method")
        if data.get("jsonrpc") != "2.0" or ("method" in data and not isinstance(method, str)) \
                or ("method" not in data and "result" not in data and "error" not in data):
            self.send_error(msg_id, -32600, "Invalid request: a JSON-RPC 2.0 message needs \"jsonrpc\": \"2.0\" "
                                            "and a string \"method\" (or a result or error).")
            return
        if not self.authorized and not self._authorize(data, msg_id, method):
            return
        if method is not None and not self._in_order(msg_id, method):
            return
        proto = self.server.protocol
        awaited = method is None and awaits_reply(proto, msg_id)
        try:
            message = proto.structure_message(data)
        except JsonRpcException as e:
            detail = _describe(e.__cause__) if e.__cause__ is not None else e.message
            if msg_id is not None and method is not None:
                self.send_error(msg_id, e.code, f"Invalid params for {method}: {detail}")
            elif awaited:
                fail_request(proto, msg_id, JsonRpcInvalidParams(
                    f"The editor's answer to request {msg_id} is not valid: {detail}"))
                log.warning("%s: the answer to request %s is not valid: %s", self.label, msg_id, detail)
            else:
                log.warning("dropped malformed %s: %s", method or "message", detail)
                if method and not method.startswith("$/"):
                    from lsprotocol.types import MessageType

                    self.server.refusals.add(MessageType.Warning, f"ignored a malformed {method} notification", detail)
            return
        proto.handle_message(message)

    def _in_order(self, msg_id, method: str) -> bool:
        """The LSP's rules for the first message, and for a notification that carries an id."""
        if msg_id is not None and _is_notification(method):
            self.send_error(msg_id, INVALID_REQUEST, f"Invalid request: {method} is a notification; "
                                                     "send it without an id (it gets no response).")
            return False
        if method == "initialize":
            self.initialized = True
            return True
        if not self.initialized and method != "exit":
            if msg_id is not None:   # notifications before initialize are dropped, as the LSP says
                self.send_error(msg_id, SERVER_NOT_INITIALIZED,
                                f"Server not initialized: send initialize before {method}.")
            return False
        return True

    def _authorize(self, data: dict, msg_id, method) -> bool:
        if method == "initialize":
            opts = (data.get("params") or {}).get("initializationOptions")
            given = opts.get("token") if isinstance(opts, dict) else None
            if token_ok(self.token, given):
                self.authorized = True
                return True
            self.send_error(msg_id, UNAUTHORIZED, "Unauthorized: this A3B server needs its token in "
                                                  "initializationOptions.token (see --token / A3B_LSP_TOKEN).")
        elif msg_id is not None:
            self.send_error(msg_id, UNAUTHORIZED, "Unauthorized: send initialize with the server's token first.")
        log.warning("%s: refused an unauthenticated %s", self.label, method)
        self.close(1)
        return False

    # -- teardown ------------------------------------------------------------------------------
    def close(self, code: int | None = None) -> None:
        if self.done:
            return
        self.done = True
        self.exit_code = code
        self.server.session.close()
        for fut in pending_requests(self.server.protocol):
            fut.cancel()
        log.info("%s closed", self.label)
        if self._on_close:
            self._on_close()


def _describe(exc: BaseException) -> str:
    try:
        import cattrs

        return "; ".join(cattrs.transform_error(exc)) or str(exc)
    except Exception:  # noqa: BLE001 - not a cattrs error: its own message will do
        return str(exc)


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
    limit = conn.deadline()
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
