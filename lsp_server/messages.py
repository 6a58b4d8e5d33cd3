"""Bad input from a client, and what the server says about it: to the client, to the user, in its log.

* `strict_converter`: the converter messages are read with takes a string, a boolean or a number
  only where the protocol says so. cattrs' default hooks convert instead (`{"text": 5}` became the
  text "5", `"applied": "no"` became True, a column of 2.7 became 2); here such a message is
  refused, with the field named.
* `Refusals`: refused edits and malformed notifications have no response to carry an error, so
  the user is told with `window/showMessage`; a burst of them (an editor replaying 400 edits the
  server cannot apply) makes one message that says how many there were, not one each.
* `ClientErrorsOnOneLine`: pygls logs every error response with its traceback. An error the
  client caused (a document that is not open, a position outside it, a malformed message) is not
  a fault of the server: it is logged on one line. Tracebacks stay for everything else.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from lsprotocol import types as T
from pygls.exceptions import JsonRpcException, JsonRpcInternalError
from pygls.protocol import default_converter

#: Refusals within this many seconds of the first one of a burst are told in one message.
REFUSAL_BURST_S = 1.0


def strict_converter():
    """pygls' converter, with strings, booleans and numbers taken only as themselves (an integer
    where a float is asked for is fine: JSON does not tell them apart)."""
    converter = default_converter()
    for kind in (str, bool, int, float):
        converter.register_structure_hook(kind, _exactly(kind))
    return converter


def _exactly(kind: type):
    def structure(value, type_):
        if not (type(value) is kind or (kind is float and type(value) is int)):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        # the hook of `int` or `str` also serves their subclasses: the protocol's enumerations
        return value if type_ is kind else type_(value)
    return structure


class Refusals:
    """Refusals of one connection, told to the user once per burst of the same kind."""

    def __init__(self, show: Callable[[T.MessageType, str], None], closed: Callable[[], bool]):
        self._show = show
        self._closed = closed
        self._bursts: dict[str, list] = {}   # what -> [count, first detail, message type, advice]

    def add(self, kind: T.MessageType, what: str, detail: str, advice: str = "") -> None:
        """Tell the user "A3B {what}: {detail} {advice}" in a moment, or count it into the message
        of the burst already waiting."""
        burst = self._bursts.get(what)
        if burst is not None:
            burst[0] += 1
            return
        self._bursts[what] = [1, detail, kind, advice]
        asyncio.get_running_loop().call_later(REFUSAL_BURST_S, self._tell, what)

    def _tell(self, what: str) -> None:
        n, detail, kind, advice = self._bursts.pop(what)
        if self._closed():
            return
        head = f"A3B {what}: {detail}" if n == 1 else f"A3B {what} {n} times; the first time: {detail}"
        self._show(kind, f"{head} {advice}".strip())


class ClientErrorsOnOneLine(logging.Filter):
    """For pygls' logger: error responses the client caused are logged on one line, without the
    traceback; its "Unable to deserialize message" reports are dropped (the connection logs each
    malformed message itself, on one line: connection.Connection.feed)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Unable to deserialize message"):
            return False
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, JsonRpcException) and not isinstance(exc, JsonRpcInternalError):
            record.msg, record.args = f"{record.getMessage()}: {type(exc).__name__}: {exc}", ()
            record.exc_info = record.exc_text = None
        return True


def install_log_filter() -> None:
    """Put the filter on pygls' JSON-RPC logger (once per process)."""
    logger = logging.getLogger("pygls.protocol.json_rpc")
    if not any(isinstance(f, ClientErrorsOnOneLine) for f in logger.filters):
        logger.addFilter(ClientErrorsOnOneLine())
