"""The units of a prompt: parts fed as embeddings instead of token ids (an image), as the scheduler
sees them: where each starts in the sequence, how many tokens it holds (`n_tokens`) and how many
positions it takes (`n_pos`: fewer than its tokens for Qwen-VL's 2-D M-RoPE).

A `Units` maps a start index to its unit; scheduler.py's Job holds one (empty for text prompts).
"""
from __future__ import annotations

from typing import Any


class Units(dict):
    """{start index in seq: unit}, with the lookups the scheduler needs (linear in the units)."""

    def __init__(self, units: dict[int, Any] | None = None):
        super().__init__(units or {})
        self.starts = sorted(self)

    def covering(self, index: int) -> tuple[int, Any] | None:
        """(start, unit) of the unit that covers `index`, or None."""
        for start in self.starts:
            if start <= index < start + self[start].n_tokens:
                return start, self[start]
            if start > index:
                break
        return None

    def position(self, index: int) -> int:
        """The position of `seq[index]`: the index less what whole units before it take beyond their positions."""
        shift = 0
        for start in self.starts:
            u = self[start]
            if start + u.n_tokens > index:
                break
            shift += u.n_tokens - u.n_pos
        return index - shift

    def segment(self, start: int, want: int) -> tuple[int, Any]:
        """(count, unit) one entry takes from `start`: a whole unit, or at most `want` tokens of text
        that stop at the next unit."""
        if start in self:
            return self[start].n_tokens, self[start]
        nxt = next((s for s in self.starts if s > start), None)
        return (want if nxt is None else min(want, nxt - start)), None


__all__ = ["Units"]
