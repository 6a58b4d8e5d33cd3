"""Speculative decoding: what a request drafts, how many tokens it may draft, and how drafts are judged.

A drafter proposes the tokens a request will probably generate next; the worker (worker.py) puts
them into the same batched decode step as the request's last token and every other request's
tokens, and verifies them row by row against the target model: the request's own sampler draws
each row in order, and a drafted token is accepted while it equals the draw. The first draw that
differs (or the draw after the last drafted token) is the next token, so every step yields at
least one token, and the rejected drafts are trimmed from the request's KV cache.

Exactness. With greedy decoding a draw is the argmax, so the text is token for token the text
without speculation. With temperature sampling and a deterministic drafter (n-gram lookup, a draft
model drafting greedily) the proposal q is a point mass on the drafted token d, and "draw x from p,
accept when x == d" is the standard speculative-sampling rule: d is accepted with probability
p(d) = min(1, p(d)/q(d)), and a rejection yields a draw from the residual max(0, p - q) normalised,
which is p without d. The accepted tokens follow p exactly, draw for draw with the same seed: the
sampler consumes one draw per generated token, as without speculation. `accept_drafts` is the
general rule for a drafter that samples its proposals from a distribution q.

Drafters here are pure Python: `NgramDrafter` (prompt lookup: the tokens that followed the latest
earlier occurrence of the sequence's last n tokens). A drafter that runs a model is driven by the
worker through the same `propose` call.

`SpecControl` adapts K (drafted tokens per step) per request from its recent acceptance: doubling
while every draft is accepted, shrinking to what was accepted otherwise, and pausing speculation
for a while (longer each time) when acceptance stays low, so a request whose text does not repeat
costs next to nothing.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .errors import InvalidRequest
from .options import SPECULATIVE_MODES as MODES  # noqa: F401 - re-exported
from .options import parse_speculative as parse_mode  # noqa: F401 - re-exported


def check_k(value) -> int:
    """A draft length: an integer >= 1 (not a bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and (not math.isfinite(value) or value != int(value))) or value < 1:
        raise InvalidRequest(f"draft_max must be an integer >= 1, got {value!r}")
    return int(value)


class NgramDrafter:
    """Prompt lookup over one growing token sequence.

    An index maps every n-gram (n in `sizes`, longest first) to the position right after its latest
    occurrence whose continuation is known. `extend` indexes new tokens (constant work per token);
    `propose` looks the sequence's last n tokens up and returns what followed them. Memory and time
    are linear in the sequence.
    """

    def __init__(self, sizes: Sequence[int] = (4, 3, 2)):
        self.sizes = tuple(sorted(sizes, reverse=True))
        self.index: dict[tuple[int, ...], int] = {}
        self.seq: list[int] = []

    def extend(self, seq: Sequence[int]) -> None:
        """Catch up with `seq` (the same sequence, grown)."""
        old = len(self.seq)
        self.seq.extend(seq[old:])
        s = self.seq
        # an n-gram ending at e (exclusive) is indexed once s[e] exists: e < len(s)
        for e in range(max(old, 1), len(s)):
            for n in self.sizes:
                if e >= n:
                    self.index[tuple(s[e - n:e])] = e

    def propose(self, k: int) -> list[int]:
        s = self.seq
        if k <= 0:
            return []
        for n in self.sizes:
            if len(s) <= n:
                continue
            at = self.index.get(tuple(s[-n:]))
            if at is not None:
                return s[at:at + k]
        return []


class SpecControl:
    """Per request: the draft length K and the acceptance statistics it is adapted from."""

    #: acceptance below this (accepted / drafted over the recent window) pauses speculation
    LOW = 0.25
    WINDOW = 16           # drafted tokens the acceptance is judged over
    PAUSE = 8             # generated tokens of the first pause; doubles each time, at most MAX_PAUSE
    MAX_PAUSE = 256

    def __init__(self, k_max: int, k_start: int | None = None):
        self.k_max = check_k(k_max)
        self.k = min(self.k_max, k_start or self.k_max)
        self.drafted = 0
        self.accepted = 0
        self.steps = 0
        self._win_drafted = 0
        self._win_accepted = 0
        self._pause_len = self.PAUSE
        self.paused_for = 0   # generated tokens left without drafting

    def room(self) -> int:
        """Tokens this request would like to draft in the next step (0: none now)."""
        return 0 if self.paused_for > 0 else self.k

    def record(self, drafted: int, accepted: int, generated: int) -> None:
        """A verified step: `drafted` proposals, `accepted` of them taken, `generated` tokens out."""
        if drafted <= 0:
            self.paused_for = max(0, self.paused_for - generated)
            return
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self._win_drafted += drafted
        self._win_accepted += accepted
        if accepted == drafted:
            self.k = min(self.k_max, max(self.k, drafted) * 2)
        else:
            self.k = max(1, accepted + 1)
        if self._win_drafted >= self.WINDOW:
            if self._win_accepted < self.LOW * self._win_drafted:
                self.paused_for = self._pause_len
                self._pause_len = min(self.MAX_PAUSE, self._pause_len * 2)
                self.k = 1
            else:
                self._pause_len = self.PAUSE
            self._win_drafted = self._win_accepted = 0


def accept_drafts(p: np.ndarray, q: np.ndarray, draft: Sequence[int], rng: np.random.Generator) -> list[int]:
    """Standard speculative sampling for drafts sampled from q.

    `p`: the target's probabilities at each drafted position and one more (len(draft) + 1 rows);
    `q`: the drafter's probabilities the drafts were drawn from (len(draft) rows). Drafted token d is
    accepted with probability min(1, p(d) / q(d)); at the first rejection the next token is drawn
    from max(0, p - q) normalised, and when all are accepted one more from the last row of p. The
    tokens returned follow p exactly (Leviathan et al., 2023; Chen et al., 2023)."""
    out: list[int] = []
    for i, d in enumerate(draft):
        pd, qd = float(p[i, d]), float(q[i, d])
        if qd <= 0 or rng.random() < min(1.0, pd / qd):
            out.append(int(d))
            continue
        resid = np.maximum(p[i] - q[i], 0.0)
        total = resid.sum()
        row = resid / total if total > 0 else p[i]
        out.append(int(rng.choice(len(row), p=row)))
        return out
    out.append(int(rng.choice(p.shape[1], p=p[len(draft)])))
    return out
