"""Open documents: text, incremental edits and position conversion.

pygls' own TextDocument splits lines with `str.splitlines`, which also breaks at form feeds and
other separators the LSP does not count (only \\n, \\r\\n and \\r end a line), and it re-splits the
whole text on every edit. Here positions mean what the client means in the negotiated encoding
(UTF-16 by default, UTF-8 or UTF-32 when the client prefers them), and an edit costs what the edit
is, not what the document is, so a keystroke in a 20 MB file (even on one 20 MB line) stays cheap:

* the text is a list of pieces: views into strings, which an edit splits without copying them. It
  is joined into one string only when a caller reads `text` (and then kept so), or once an edit
  makes more than MAX_PIECES pieces;
* line starts are an array that each edit updates: the starts inside the edited range are found
  again, the ones after it move by the change in length;
* a position is converted from its line's start without copying the line when every character
  takes one unit of the encoding (ASCII text; in UTF-16, text without characters outside the BMP),
  and from the first `character` code points of the line otherwise.
"""
from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass

import numpy as np
from lsprotocol import types

_EOL = re.compile(r"\r\n|\r|\n")
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")   # two UTF-16 units each
#: More pieces than this and the text is joined (once every MAX_PIECES scattered edits at most).
MAX_PIECES = 64
#: Neighbouring pieces shorter than this together are merged: typing at one spot makes one piece.
SMALL_PIECE = 1024


class DocumentError(ValueError):
    """A request names a position or document the server cannot use; the message says why."""


def open_document(docs: dict[str, Document], uri: str) -> Document:
    """The open document `uri` of `docs`; DocumentError when the editor has not opened it."""
    d = docs.get(uri)
    if d is None:
        raise DocumentError(f"{uri} is not open; send textDocument/didOpen first.")
    return d


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
        self.version = version
        self.language_id = language_id or ""
        self._reset(text)

    def _reset(self, text: str) -> None:
        self._pieces: list[tuple[str, int, int]] = [(text, 0, len(text))] if text else []   # (string, start, end)
        self._ends: list[int] = [len(text)] if text else []     # document offset where each piece ends
        self._len = len(text)
        self._ascii = text.isascii()
        self._astral = not self._ascii and _ASTRAL.search(text) is not None
        self._nul = "\x00" in text      # may stay set after the NUL is deleted: check_usable looks again
        self._starts: np.ndarray | None = None

    # -- text ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    @property
    def text(self) -> str:
        """The whole text (joined now if edits left it in pieces)."""
        return self._join()

    def _join(self) -> str:
        if len(self._pieces) == 1 and self._pieces[0][1] == 0 and self._pieces[0][2] == len(self._pieces[0][0]):
            return self._pieces[0][0]
        t = "".join(src[a:b] for src, a, b in self._pieces)
        self._pieces, self._ends = ([(t, 0, len(t))], [len(t)]) if t else ([], [])
        return t

    def slice(self, i: int, j: int) -> str:
        """text[i:j] (i, j >= 0), copying only those characters."""
        return "".join(src[a:b] for src, a, b in self._views(i, j))

    def snapshot(self) -> Snapshot:
        """This version's text, to be read later or on another thread."""
        return Snapshot(tuple(self._pieces), self._len)

    def _views(self, i: int, j: int) -> list[tuple[str, int, int]]:
        """Views (string, start, end) covering text[i:j]."""
        i, j = max(0, i), min(j, self._len)
        out = []
        k = bisect.bisect_right(self._ends, i)
        while i < j:
            src, a, b = self._pieces[k]
            at = self._ends[k] - (b - a)           # document offset of this piece
            stop = min(j, self._ends[k])
            out.append((src, a + i - at, a + stop - at))
            i, k = stop, k + 1
        return out

    # -- lines ---------------------------------------------------------------------------------
    @property
    def line_starts(self) -> np.ndarray:
        if self._starts is None:
            self._starts = np.array([0, *(m.end() for m in _EOL.finditer(self.text))], dtype=np.int64)
        return self._starts

    def line_count(self) -> int:
        return len(self.line_starts)

    def _line_span(self, line: int) -> tuple[int, int]:
        """(start, end) offsets of line `line` without its line ending."""
        starts = self.line_starts
        s = int(starts[line])
        e = int(starts[line + 1]) if line + 1 < len(starts) else self._len
        for end in ("\n", "\r"):   # \r\n, \n or \r
            if e > s and self.slice(e - 1, e) == end:
                e -= 1
        return s, e

    def line_text(self, line: int) -> str:
        """Line `line` without its line ending."""
        return self.slice(*self._line_span(line))

    # -- positions -----------------------------------------------------------------------------
    def _one_unit_each(self, encoding: str) -> bool:
        """Every character takes exactly one unit of `encoding` in this text."""
        return encoding == "utf-32" or self._ascii or (encoding == "utf-16" and not self._astral)

    def offset_at(self, pos: types.Position, encoding: str = "utf-16", what: str = "position") -> int:
        """Code-point offset of a client position. Characters past the line end mean the line end
        (as the LSP specifies); a line past the end of the document is an error."""
        n = self.line_count()
        if not 0 <= pos.line < n:
            raise DocumentError(f"The {what} {pos.line}:{pos.character} is outside the document {self.uri} "
                                f"(it has {n} lines, numbered 0..{n - 1}).")
        s, e = self._line_span(pos.line)
        units = pos.character
        if units <= 0:
            return s
        if self._one_unit_each(encoding):
            return s + min(units, e - s)
        # each code point takes at least one unit: the first `units` of them are enough
        return s + _units_to_index(self.slice(s, s + min(units, e - s)), units, encoding)

    def position_at(self, offset: int, encoding: str = "utf-16") -> types.Position:
        offset = max(0, min(offset, self._len))
        line = int(np.searchsorted(self.line_starts, offset, "right")) - 1
        s, e = self._line_span(line)
        col = min(offset, e) - s
        if col and not self._one_unit_each(encoding):
            col = _index_to_units(self.slice(s, s + col), encoding)
        return types.Position(line=line, character=col)

    def range_at(self, start: int, end: int, encoding: str = "utf-16") -> types.Range:
        return types.Range(start=self.position_at(start, encoding), end=self.position_at(end, encoding))

    # -- edits ---------------------------------------------------------------------------------
    def apply(self, change, encoding: str = "utf-16") -> int:
        """Apply one content change; return the offset just after the inserted text (where the
        user's cursor most likely is), or the end of the text for a full replacement."""
        new = change.text
        if not isinstance(change, types.TextDocumentContentChangePartial):
            self._reset(new)
            return self._len
        a = self.offset_at(change.range.start, encoding, "edit start")
        b = self.offset_at(change.range.end, encoding, "edit end")
        if b < a:
            raise DocumentError(f"Edit range ends before it starts in {self.uri}.")
        if self._starts is not None:
            self._starts = self._moved_starts(a, b, new)
        pieces = [*self._views(0, a), *([(new, 0, len(new))] if new else []), *self._views(b, self._len)]
        self._pieces = _merge_small(pieces)
        self._ends = list(itertools.accumulate(e - s for _, s, e in self._pieces))
        self._len += len(new) - (b - a)
        if len(self._pieces) > MAX_PIECES:
            self._join()
        self._ascii = self._ascii and new.isascii()
        self._astral = self._astral or (not new.isascii() and _ASTRAL.search(new) is not None)
        self._nul = self._nul or "\x00" in new
        return a + len(new)

    def _moved_starts(self, a: int, b: int, new: str) -> np.ndarray:
        """The line starts once text[a:b] is `new`. Whether an offset starts a line depends on the
        character before it and on itself (\\r\\n is one line end), so only the starts from a to
        a + len(new) are found again; the ones before stay, the ones after move."""
        starts = self._starts
        keep = int(np.searchsorted(starts, a, "left"))       # starts < a
        after = int(np.searchsorted(starts, b, "right"))     # starts > b
        lo = max(0, a - 1)
        region = self.slice(lo, a) + new + self.slice(b, b + 1)
        mid = [lo + m.end() for m in _EOL.finditer(region)]
        mid = ([0] if a == 0 else []) + [p for p in mid if a <= p <= a + len(new)]
        return np.concatenate((starts[:keep], np.array(mid, dtype=np.int64), starts[after:] + (len(new) - (b - a))))

    # -- checks --------------------------------------------------------------------------------
    def check_usable(self, max_bytes: int) -> None:
        """Refuse documents the model should not see: binary content, or larger than `max_bytes`."""
        size = self._len  # code points; a lower bound of the UTF-8 size, and cheap
        if size > max_bytes:
            raise DocumentError(f"{self.uri} is {size / 1e6:.1f} MB; A3B completes documents up to "
                                f"{max_bytes / 1e6:.1f} MB (setting maxDocumentBytes).")
        if self._nul:
            self._nul = "\x00" in self.text
        if self._nul:
            raise DocumentError(f"{self.uri} looks binary (it contains NUL characters); A3B does not "
                                "complete binary files.")

    def cursor(self, pos: types.Position, encoding: str, window: int = 16384, suffix_window: int = 4096) -> Cursor:
        return self.cursor_at(self.offset_at(pos, encoding), window, suffix_window)

    def cursor_at(self, off: int, window: int = 16384, suffix_window: int = 4096) -> Cursor:
        """The Cursor at code-point offset `off`."""
        ps = max(0, off - window)
        starts = self.line_starts
        line_no = int(np.searchsorted(starts, off, "right")) - 1
        line = int(starts[line_no])
        line_end = int(starts[line_no + 1]) if line_no + 1 < len(starts) else self._len
        return Cursor(uri=self.uri, offset=off, prefix=self.slice(ps, off), prefix_start=ps,
                      suffix=self.slice(off, off + suffix_window), line_prefix=self.slice(line, off),
                      line_suffix=self.slice(off, line_end).rstrip("\r\n"), language_id=self.language_id,
                      version=self.version)


class Snapshot:
    """The text of one version of a document, joined when first read; safe to read on any thread
    (the pieces are immutable strings)."""

    __slots__ = ("_pieces", "_len", "_text")

    def __init__(self, pieces: tuple[tuple[str, int, int], ...], length: int):
        self._pieces, self._len, self._text = pieces, length, None

    def __len__(self) -> int:
        return self._len

    def text(self) -> str:
        if self._text is None:
            self._text = "".join(src[a:b] for src, a, b in self._pieces)
        return self._text


def _merge_small(pieces: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    out: list[tuple[str, int, int]] = []
    for src, a, b in pieces:
        if out and (b - a) + (out[-1][2] - out[-1][1]) <= SMALL_PIECE:
            psrc, pa, pb = out[-1]
            joined = psrc[pa:pb] + src[a:b]
            out[-1] = (joined, 0, len(joined))
        else:
            out.append((src, a, b))
    return out


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


def _units(line: str, index: int, encoding: str) -> int:
    return _index_to_units(line[:index], encoding)
