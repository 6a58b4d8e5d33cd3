"""One editor connection: its server object, and the JSON-RPC checks in front of pygls.

What this adds to pygls' handling of a message, whatever the transport (transport.py):

* JSON-RPC errors that pygls leaves unanswered: a body that is not JSON gets a Parse error (-32700),
  a message that is not a JSON-RPC 2.0 object an Invalid request (-32600), a request whose params do
  not match the LSP types an Invalid params (-32602) naming the field; all with the request's id when
  there is one, so a client never waits for an answer that will not come;
* the LSP's order: nothing but `exit` before `initialize`, no id on a notification;
* the token of a TCP/WS server (initializationOptions.token), checked before anything else is served.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable

from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams

from ..runtime.netguard import token_ok
from .engine import Engine
from .pygls_compat import awaits_reply, fail_request, pending_requests, send_raw
from .server import A3BServer

log = logging.getLogger("a3b.lsp")

UNAUTHORIZED = -32001
SERVER_NOT_INITIALIZED = -32002
INVALID_REQUEST = -32600


def _is_notification(method: str) -> bool:
    """An LSP notification (its spec defines no response), as opposed to a request."""
    from lsprotocol.types import METHOD_TO_TYPES

    types = METHOD_TO_TYPES.get(method)
    return types is not None and types[1] is None


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
