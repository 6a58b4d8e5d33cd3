"""Stop-string matching in time linear in the generated text, whatever the stop strings' length.

One Knuth-Morris-Pratt automaton per stop string. Its state is the length of the longest prefix of
the stop string that the text seen so far ends with: that is both how much text must be held back
(it could be the start of the stop string) and, when it reaches the string's length, a match. Each
character moves every automaton in amortised constant time, so a token costs time in proportion to
the text it adds, not to the length of the stop strings (a search of the whole held-back tail per
token would cost the stop string's length; trying every prefix of it, the square of that).

The failure table (for each i, the longest proper prefix of s[:i+1] that is also its suffix) is built
lazily: entry i is needed only once i+1 characters of the string have matched, so a request pays for
the text it generates, never for the length of a stop string it never gets near.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence


class _Automaton:
    __slots__ = ("s", "fail", "state")

    def __init__(self, s: str):
        self.s = s
        self.fail = array("q", [0])   # always at least `state` entries long
        self.state = 0

    def _extend(self) -> None:
        """One more entry of the failure table (the classic prefix-function step)."""
        s, fail = self.s, self.fail
        j = len(fail)
        k = fail[j - 1]
        while k and s[j] != s[k]:
            k = fail[k - 1]
        fail.append(k + 1 if s[j] == s[k] else k)

    def feed(self, text: str) -> int:
        """Advance over `text`; the index in it where the stop string first ends, or -1."""
        s, fail, q, n = self.s, self.fail, self.state, len(self.s)
        for i, c in enumerate(text):
            while q and s[q] != c:
                q = fail[q - 1]
            if s[q] == c:
                q += 1
                if q == n:
                    self.state = q
                    return i
                if q > len(fail):
                    self._extend()
        self.state = q
        return -1


class StopMatcher:
    """Finds the first stop string in a text given piece by piece, and how much of its end to hold back."""

    def __init__(self, stops: Sequence[str]):
        self._automata = [_Automaton(s) for s in stops if s]

    def feed(self, text: str, offset: int) -> int:
        """Feed the next piece of the text, which starts at character `offset` of the whole; the start
        of the earliest stop string that ends inside this piece, or -1."""
        best = -1
        for a in self._automata:
            end = a.feed(text)
            if end >= 0:
                start = offset + end + 1 - len(a.s)
                if best < 0 or start < best:
                    best = start
        return best

    @property
    def hold(self) -> int:
        """Characters at the end of the text that could still begin a stop string."""
        return max((a.state for a in self._automata), default=0)


class IndentStop:
    """llama-server's `n_indent`: every line after the first must be indented by at least `n` spaces
    or tabs; the first one that is not (an empty line included) ends the text where it begins.

    Fed piece by piece like StopMatcher: while a line's leading whitespace is still shorter than `n`
    it is held back, since the next character decides; each character is looked at once."""

    def __init__(self, n: int):
        self.n = n
        self._line: int | None = None   # start of the line being read after a newline, until decided
        self._width = 0

    def feed(self, text: str, offset: int) -> int:
        """The start of the first line that is indented too little, ending in this piece, or -1."""
        for i, c in enumerate(text):
            if self._line is None:
                if c == "\n":
                    self._line, self._width = offset + i + 1, 0
            elif c in " \t":
                self._width += 1
                if self._width >= self.n:
                    self._line = None
            else:   # text (or another line break) before the line is indented enough
                return self._line
        return -1

    def hold(self, end: int) -> int:
        """Characters at the end of a text of length `end` that are held back (an undecided line)."""
        return 0 if self._line is None else end - self._line
