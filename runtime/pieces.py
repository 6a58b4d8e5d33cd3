"""Text that grows piece by piece (a generation's tokens), kept as its pieces.

A str grown with `+=` is copied whole at every token, which makes a long generation cost the square
of its length; here appending costs the piece, and reading a range of characters costs that range
(and a binary search for where it starts).
"""
from __future__ import annotations

from bisect import bisect_right


class PieceText:
    def __init__(self):
        self._pieces: list[str] = []
        self._starts: list[int] = []     # character offset of each piece
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        return "".join(self._pieces)

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._starts.append(self._len)
            self._len += len(piece)

    def slice(self, a: int, b: int) -> str:
        """Characters a..b (clipped to the text)."""
        b = min(b, self._len)
        if a >= b:
            return ""
        i = bisect_right(self._starts, a) - 1
        out = []
        while i < len(self._pieces) and self._starts[i] < b:
            s = self._starts[i]
            out.append(self._pieces[i][max(0, a - s):b - s])
            i += 1
        return "".join(out)

    def cut(self, n: int) -> None:
        """Keep only the first n characters."""
        if n >= self._len:
            return
        i = bisect_right(self._starts, n) - 1 if n > 0 else -1
        if i >= 0:
            self._pieces[i] = self._pieces[i][:n - self._starts[i]]
            if not self._pieces[i]:
                i -= 1
        del self._pieces[i + 1:], self._starts[i + 1:]
        self._len = n
