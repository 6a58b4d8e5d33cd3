"""The pygls internals the language server relies on, in one place.

Written against pygls 2.1.1. pygls has no public API for some things this server needs, so they use
private attributes of `JsonRPCProtocol` here, and nowhere else:

* `_send_data(data)` writes one JSON-RPC message through the protocol's writer, framed as the
  connection expects (headers on streams, none on WebSocket). The public senders only write
  responses to requests pygls has parsed, notifications and requests; the errors pygls never sends
  itself need this: a Parse error or Invalid request with id null, Invalid params naming the field,
  Unauthorized before `initialize`.
* `_request_futures` maps message ids to the futures of the requests in flight, in both directions
  (requests being answered, requests awaiting the client's reply). A connection that goes away must
  cancel them all; pygls cancels them only on `shutdown`. A reply that cannot be read ends its
  request with an error (pygls drops such a reply and leaves the request waiting forever).
* `_result_types` maps the ids of the requests this server sent to the type of their reply: an id
  in it is one the client has still to answer, and not one of the client's own requests.

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
PRIVATE_ATTRIBUTES = ("_send_data", "_request_futures", "_result_types")


def send_raw(protocol: JsonRPCProtocol, message: dict[str, Any]) -> None:
    """Write `message` (a JSON-RPC message as a dict) to the client as it is."""
    protocol._send_data(message)


def pending_requests(protocol: JsonRPCProtocol) -> list[Any]:
    """The futures of every request in flight on this connection: asyncio futures of requests being
    answered, concurrent futures of requests awaiting the client's reply (both can be cancelled)."""
    return list(protocol._request_futures.values())


def awaits_reply(protocol: JsonRPCProtocol, msg_id: Any) -> bool:
    """Whether `msg_id` is a request this server sent that the client has not answered yet (not
    a request of the client's: those share `_request_futures`). Ask before the reply is read:
    reading it forgets the request's result type."""
    return msg_id in protocol._result_types and msg_id in protocol._request_futures


def fail_request(protocol: JsonRPCProtocol, msg_id: Any, error: BaseException) -> None:
    """End the request `msg_id` this server sent with `error` (the reply came but cannot be read).
    Only for an id `awaits_reply` said yes to."""
    protocol._result_types.pop(msg_id, None)
    fut = protocol._request_futures.pop(msg_id)
    if not fut.done():
        fut.set_exception(error)


def has_workspace(server: LanguageServer) -> bool:
    """Whether `initialize` has created the workspace (before that, pygls' `workspace` raises)."""
    try:
        return server.workspace is not None
    except RuntimeError:
        return False
