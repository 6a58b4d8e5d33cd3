"""Open documents: text, incremental edits and position conversion.

pygls' own TextDocument splits lines with `str.splitlines`, which also breaks at form feeds and
other separators the LSP does not count (only \\n, \\r\\n and \\r end a line), and it re-splits the
whole text on every edit. Here line starts are found once per version with a regular expression,
so a 10 MB document or a burst of a thousand edits stays cheap, and positions mean what the client
means in the negotiated encoding (UTF-16 by default, UTF-8 or UTF-32 when the client prefers them).
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from lsprotocol import types

_EOL = re.compile(r"\r\n|\r|\n")


class DocumentError(ValueError):
    """A request names a position or document the server cannot use; the message says why."""


@dataclass
class Cursor:
    """Where a completion is asked for, as text around the cursor."""

    uri: str
    offset: int             # code points before the cursor
    prefix: str             # text before the cursor (possibly a window of it, see `Document.cursor`)
    prefix_start: int       # offset of prefix[0] in the document
    suffix: str             # text after the cursor (a window)
    line_prefix: str        # current line up to the cursor
    line_suffix: str        # current line after the cursor
    language_id: str
    version: int


class Document:
    def __init__(self, uri: str, text: str, version: int = 0, language_id: str = ""):
        self.uri = uri
        self.text = text
        self.version = version
        self.language_id = language_id or ""
        self._starts: list[int] | None = None

    # -- lines ---------------------------------------------------------------------------------
    @property
    def line_starts(self) -> list[int]:
        if self._starts is None:
            self._starts = [0] + [m.end() for m in _EOL.finditer(self.text)]
        return self._starts

    def line_count(self) -> int:
        return len(self.line_starts)

    def line_text(self, line: int) -> str:
        """Line `line` without its line ending."""
        starts = self.line_starts
        s = starts[line]
        e = starts[line + 1] if line + 1 < len(starts) else len(self.text)
        return self.text[s:e].rstrip("\r\n")

    # -- positions -----------------------------------------------------------------------------
    def offset_at(self, pos: types.Position, encoding: str = "utf-16", what: str = "position") -> int:
        """Code-point offset of a client position. Characters past the line end mean the line end
        (as the LSP specifies); a line past the end of the document is an error."""
        n = self.line_count()
        if pos.line >= n:
            raise DocumentError(f"The {what} {pos.line}:{pos.character} is outside the document {self.uri} "
                                f"(it has {n} lines, numbered 0..{n - 1}).")
        line = self.line_text(pos.line)
        return self.line_starts[pos.line] + _units_to_index(line, pos.character, encoding)

    def position_at(self, offset: int, encoding: str = "utf-16") -> types.Position:
        offset = max(0, min(offset, len(self.text)))
        line = bisect.bisect_right(self.line_starts, offset) - 1
        col = offset - self.line_starts[line]
        return types.Position(line=line, character=_index_to_units(self.line_text(line)[:col] if col else "",
                                                                   encoding))

    def range_at(self, start: int, end: int, encoding: str = "utf-16") -> types.Range:
        return types.Range(start=self.position_at(start, encoding), end=self.position_at(end, encoding))

    # -- edits ---------------------------------------------------------------------------------
    def apply(self, change, encoding: str = "utf-16") -> int:
        """Apply one content change; return the offset just after the inserted text (where the
        user's cursor most likely is), or the end of the text for a full replacement."""
        if isinstance(change, types.TextDocumentContentChangePartial):
            a = self.offset_at(change.range.start, encoding, "edit start")
            b = self.offset_at(change.range.end, encoding, "edit end")
            if b < a:
                raise DocumentError(f"Edit range ends before it starts in {self.uri}.")
            self.text = self.text[:a] + change.text + self.text[b:]
            end = a + len(change.text)
        else:
            self.text = change.text
            end = len(self.text)
        self._starts = None
        return end

    # -- checks --------------------------------------------------------------------------------
    def check_usable(self, max_bytes: int) -> None:
        """Refuse documents the model should not see: binary content, or larger than `max_bytes`."""
        size = len(self.text)  # code points; a lower bound of the UTF-8 size, and cheap
        if size > max_bytes:
            raise DocumentError(f"{self.uri} is {size / 1e6:.1f} MB; A3B completes documents up to "
                                f"{max_bytes / 1e6:.1f} MB (setting maxDocumentBytes).")
        if "\x00" in self.text:
            raise DocumentError(f"{self.uri} looks binary (it contains NUL characters); A3B does not "
                                "complete binary files.")

    def cursor(self, pos: types.Position, encoding: str, window: int = 16384, suffix_window: int = 4096) -> Cursor:
        return self.cursor_at(self.offset_at(pos, encoding), window, suffix_window)

    def cursor_at(self, off: int, window: int = 16384, suffix_window: int = 4096) -> Cursor:
        """The Cursor at code-point offset `off`."""
        ps = max(0, off - window)
        line_no = bisect.bisect_right(self.line_starts, off) - 1
        line = self.line_starts[line_no]
        line_end = self.line_starts[line_no + 1] if line_no + 1 < self.line_count() else len(self.text)
        return Cursor(uri=self.uri, offset=off, prefix=self.text[ps:off], prefix_start=ps,
                      suffix=self.text[off:off + suffix_window], line_prefix=self.text[line:off],
                      line_suffix=self.text[off:line_end].rstrip("\r\n"), language_id=self.language_id,
                      version=self.version)


def _units_to_index(line: str, units: int, encoding: str) -> int:
    if units <= 0:
        return 0
    if line.isascii() or encoding == "utf-32":
        return min(units, len(line))
    if encoding == "utf-8":
        data = line.encode("utf-8", "surrogatepass")
        return len(data[:units].decode("utf-8", "ignore"))
    data = line.encode("utf-16-le", "surrogatepass")
    return len(data[:units * 2].decode("utf-16-le", "ignore"))


def _index_to_units(text: str, encoding: str) -> int:
    if text.isascii() or encoding == "utf-32":
        return len(text)
    if encoding == "utf-8":
        return len(text.encode("utf-8", "surrogatepass"))
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def safe_text(s: str) -> str:
    """`s` with lone surrogates (from a mis-decoded file) replaced, so it can be tokenized."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "replace").decode("utf-8")
