"""The pygls internals the language server relies on, in one place.

Written against pygls 2.1.1. pygls has no public API for two things this server needs, so they use
private attributes of `JsonRPCProtocol` here, and nowhere else:

* `_send_data(data)` writes one JSON-RPC message through the protocol's writer, framed as the
  connection expects (headers on streams, none on WebSocket). The public senders only write
  responses to requests pygls has parsed, notifications and requests; the errors pygls never sends
  itself need this: a Parse error or Invalid request with id null, Invalid params naming the field,
  Unauthorized before `initialize`.
* `_request_futures` maps message ids to the futures of the requests in flight, in both directions
  (requests being answered, requests awaiting the client's reply). A connection that goes away must
  cancel them all; pygls cancels them only on `shutdown`.

tests/test_lsp_units.py checks that each attribute in PRIVATE_ATTRIBUTES still exists and still has
the shape used here, so a pygls upgrade that changes them fails that test, not an editor's connection.

What has a public way is used directly elsewhere: the converter comes from the server's
`converter_factory`, the protocol is given its server in its constructor, and `shutdown` is a
registered feature. `has_workspace` is here because it depends on how pygls reports a missing
workspace.
"""
from __future__ import annotations

from typing import Any

from pygls.lsp.server import LanguageServer
from pygls.protocol import JsonRPCProtocol

#: Private attributes of JsonRPCProtocol used below; the unit test checks the shape of each.
PRIVATE_ATTRIBUTES = ("_send_data", "_request_futures")


def send_raw(protocol: JsonRPCProtocol, message: dict[str, Any]) -> None:
    """Write `message` (a JSON-RPC message as a dict) to the client as it is."""
    protocol._send_data(message)


def pending_requests(protocol: JsonRPCProtocol) -> list[Any]:
    """The futures of every request in flight on this connection: asyncio futures of requests being
    answered, concurrent futures of requests awaiting the client's reply (both can be cancelled)."""
    return list(protocol._request_futures.values())


def has_workspace(server: LanguageServer) -> bool:
    """Whether `initialize` has created the workspace (before that, pygls' `workspace` raises)."""
    try:
        return server.workspace is not None
    except RuntimeError:
        return False
