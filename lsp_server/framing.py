"""LSP base-protocol framing, without I/O: one parser that stdio and TCP feed with the bytes they read.

Only Content-Length / Content-Type headers are accepted and sizes are bounded; `_frame` writes one
message the same way, for answers sent outside pygls (a refused connection).
"""
from __future__ import annotations

import json

MAX_MESSAGE_BYTES = 64 * 1024 * 1024     # a 10 MB document, JSON-escaped, fits with room to spare
MAX_HEADER_BYTES = 8192

class FramingError(Exception):
    """Bytes that are not LSP framing; the connection cannot continue.

    `messages`: the bodies completed before those bytes (see FrameParser.feed).
    """

    def __init__(self, message: str, messages: list[bytes] | None = None):
        super().__init__(message)
        self.messages = messages or []


class FrameParser:
    """LSP base-protocol framing without I/O: bytes in, complete message bodies out.

    A message is header lines ("Name: value" ending in \\r\\n or \\n), a blank line, then
    Content-Length bytes of body. Only Content-Length and Content-Type headers are accepted (anything
    else is not an LSP stream: an HTTP request, say), a header line longer than MAX_HEADER_BYTES or
    a body larger than MAX_MESSAGE_BYTES is refused, and blank lines between messages are skipped.
    Bytes can arrive split anywhere; an incomplete message waits for the next `feed`.
    """

    def __init__(self):
        self._buf = bytearray()
        self._headers: dict[str, str] = {}
        self._length: int | None = None     # body length, once the headers are complete
        self._failed: FramingError | None = None

    def feed(self, data: bytes) -> list[bytes]:
        """The bodies of the messages that `data` completes, in order.

        Raises FramingError at bytes that break the framing; its `messages` are the bodies completed
        before them, for the caller to serve first. The stream cannot be resynchronised after that:
        every later `feed` raises the same error.
        """
        if self._failed is not None:
            raise FramingError(str(self._failed))
        self._buf += data
        bodies: list[bytes] = []
        try:
            while (body := self._next()) is not None:
                bodies.append(body)
        except FramingError as e:
            self._failed = FramingError(str(e), bodies)
            raise self._failed from None
        return bodies

    def _next(self) -> bytes | None:
        while self._length is None:
            line = self._line()
            if line is None:
                return None
            if line in (b"\r\n", b"\n"):
                if self._headers:
                    self._length = _content_length(self._headers)
                continue
            _header(line, self._headers)
        if len(self._buf) < self._length:
            return None
        body = bytes(self._buf[:self._length])
        del self._buf[:self._length]
        self._headers, self._length = {}, None
        return body

    def _line(self) -> bytes | None:
        """The next header line with its line end, or None until it is complete."""
        i = self._buf.find(b"\n", 0, MAX_HEADER_BYTES + 1)
        if i < 0:
            if len(self._buf) > MAX_HEADER_BYTES:
                raise FramingError("A header line is too long.")
            return None
        line = bytes(self._buf[:i + 1])
        del self._buf[:i + 1]
        return line


def _content_length(headers: dict[str, str]) -> int:
    if "content-length" not in headers:
        raise FramingError("A message header without Content-Length.")
    try:
        n = int(headers["content-length"])
    except ValueError:
        raise FramingError(f"Content-Length is not a number: {headers['content-length']!r}.") from None
    if not 0 <= n <= MAX_MESSAGE_BYTES:
        raise FramingError(f"A message of {n} bytes is larger than the limit of {MAX_MESSAGE_BYTES} bytes.")
    return n


def _header(line: bytes, headers: dict[str, str]) -> None:
    if len(line) > MAX_HEADER_BYTES:
        raise FramingError("A header line is too long.")
    name, sep, value = line.decode("ascii", "replace").partition(":")
    name = name.strip().lower()
    if not sep or name not in ("content-length", "content-type"):
        raise FramingError(f"Not an LSP header: {line[:60]!r} (expected Content-Length).")
    headers[name] = value.strip()


def _frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body
