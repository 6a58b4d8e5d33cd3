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

`SpecControl` adapts K (drafted tokens per step) per request from its recent acceptance and what an
extra token costs in a step on this model here (`StepCost`, measured by the worker), and pauses
speculation for a while (longer each time) when no K pays, so a request whose text does not repeat
costs next to nothing.
"""
from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence

import numpy as np

from ..errors import InvalidRequest
from ..options import SPECULATIVE_MODES as MODES  # noqa: F401 - re-exported
from ..options import parse_speculative as parse_mode  # noqa: F401 - re-exported


def check_k(value) -> int:
    """A draft length: an integer >= 1 (not a bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and (not math.isfinite(value) or value != int(value))) or value < 1:
        raise InvalidRequest(f"draft_max must be an integer >= 1, got {value!r}")
    return int(value)


class Drafter:
    """What the worker drives for one request (drafting.fill), in two phases so that a drafter that
    runs a model drafts for every request of a step in one batch: `extend` with the request's tokens,
    `place` where its next token sits (a drafter that reads the request's cache needs it), `begin`
    asking for `k` tokens, and after every request has begun, `end` with the drafts. A drafter that
    answers at once implements `propose` and keeps the rest."""

    _k = 0

    def extend(self, seq: Sequence[int]) -> None:
        raise NotImplementedError

    def propose(self, k: int) -> list[int]:
        raise NotImplementedError

    def place(self, seq_id: int, position: int) -> None:
        """Where the request's next token goes: its sequence and position."""

    def begin(self, k: int, priority: int = 0) -> None:
        self._k = k

    def end(self) -> list[int]:
        k, self._k = self._k, 0
        return self.propose(k)


class NgramDrafter(Drafter):
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


class StepCost:
    """What a decode step costs on this model here, learnt from the steps the worker times: the time
    of a step of one token per sequence for each number of sequences (`base_at`) and what each extra
    token adds (`per_token`), each the median of the last WINDOW steps of its kind. On a GPU an extra
    token costs a few percent of a step; on a CPU with a small model it can cost half a step or more,
    so the best K differs by an order of magnitude between machines and is measured, not assumed.
    Medians, because the first step of a new batch size also builds its compute graph (many times a
    step), and a busy machine stalls a step now and then: an average would remember those for long.

    What a draft costs is judged against the drafting request's share of its step (`extra_at`): on
    a CPU a step of four sequences costs about four single ones (the work is arithmetic, not reading
    the weights), so a drafted token costs a whole share and slows the other three, and drafting at
    four requests lost a third of the throughput where it gained at one. Part of that cost is
    llama.cpp's: with a KV stream per sequence it cuts a batch into micro-batches of as many tokens
    from each sequence (its equal split), so a step where one sequence drafts runs as two passes
    (drafting.even cuts such drafts where they bring less than the pass costs); the timed steps
    carry what remains, whatever its cause."""

    WINDOW = 15
    MIN_S = 1e-3
    ROW_COUNTS = 64   # row counts remembered (a model serves at most this many in a step, in practice)

    def __init__(self, extra: float = 0.25):
        self._base: dict[int, collections.deque[float]] = {}
        self._slope: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self._prior = extra

    def record(self, n_tokens: int, n_rows: int, seconds: float) -> None:
        """A decode step of `n_tokens` tokens for `n_rows` sequences took `seconds`. Steps under
        MIN_S are not timed: there the clock and the interpreter say more than the model."""
        if seconds < self.MIN_S or n_rows < 1:
            return
        if n_tokens <= n_rows:
            if n_rows not in self._base and len(self._base) >= self.ROW_COUNTS:
                return
            self._base.setdefault(n_rows, collections.deque(maxlen=self.WINDOW)).append(seconds)
        elif (base := self.base_at(n_rows)) is not None:
            self._slope.append(max(0.0, seconds - base) / (n_tokens - n_rows))

    def base_at(self, rows: int) -> float | None:
        """A step of one token for each of `rows` sequences: measured, or from the nearest row count
        measured, scaled by the rows (None: nothing measured yet)."""
        if rows in self._base:
            return statistics.median(self._base[rows])
        if not self._base:
            return None
        near = min(self._base, key=lambda r: (abs(r - rows), r))
        return statistics.median(self._base[near]) * rows / near

    @property
    def base(self) -> float | None:
        """A step of one sequence (estimated from others when none was measured alone)."""
        return self.base_at(1)

    def extra_at(self, rows: int = 1) -> float:
        """An extra token's cost as a fraction of one request's share of a step of `rows` sequences
        (the prior until both are measured)."""
        rows = max(1, rows)
        base = self.base_at(rows)
        if not base or not self._slope:
            return self._prior
        return statistics.median(self._slope) * rows / base

    @property
    def extra(self) -> float:
        """An extra token's cost as a fraction of a step of one sequence."""
        return self.extra_at(1)


def best_k(accept: float, extra: float, k_max: int) -> int:
    """The draft length that maximises expected tokens per unit of time: with each drafted token
    accepted with probability `accept` (given the ones before it were), K drafts yield
    (1 - accept**(K+1)) / (1 - accept) tokens for a step that costs 1 + K * extra; 0 when no K beats
    decoding alone."""
    best, value = 0, 1.0
    for k in range(1, k_max + 1):
        tokens = k + 1 if accept >= 1 else (1 - accept ** (k + 1)) / (1 - accept)
        v = tokens / (1 + k * extra)
        if v > value * 1.02:   # a clear gain only: a measured cost is noisy
            best, value = k, v
    return best


class SpecControl:
    """Per request: the draft length K, from the request's acceptance and the model's step cost.

    Acceptance is estimated per drafted position (accepted / positions tried, an exponential moving
    average that starts optimistic), K is `best_k` for it and the measured cost (`StepCost`). When
    no K pays, speculation pauses for a while (longer each time), then tries one token again."""

    ALPHA = 0.3
    PAUSE = 8             # generated tokens of the first pause; doubles each time, at most MAX_PAUSE
    MAX_PAUSE = 256

    def __init__(self, k_max: int, cost: StepCost | None = None, accept: float = 0.8):
        self.k_max = check_k(k_max)
        self.cost = cost or StepCost()
        self.rate = accept
        self.drafted = 0
        self.accepted = 0
        self.steps = 0
        self._pause_len = self.PAUSE
        self.paused_for = 0   # generated tokens left without drafting
        self._probe = False
        self._rows = 1

    def room(self, rows: int = 1) -> int:
        """Tokens this request would like to draft in the next step, a step of `rows` sequences
        (0: none now)."""
        self._rows = max(1, rows)
        if self.paused_for > 0:
            return 0
        if self._probe:
            return 1
        return best_k(self.rate, self.cost.extra_at(self._rows), self.k_max)

    def record(self, drafted: int, accepted: int, generated: int) -> None:
        """A verified step: `drafted` proposals, `accepted` of them taken, `generated` tokens out."""
        if drafted <= 0:
            was = self.paused_for
            self.paused_for = max(0, self.paused_for - generated)
            self._probe = self._probe or (was > 0 and self.paused_for == 0)
            return
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        tried = accepted + (1 if accepted < drafted else 0)
        self.rate += self.ALPHA * (accepted / tried - self.rate)
        probed, self._probe = self._probe, False
        if (probed and accepted == 0) or best_k(self.rate, self.cost.extra_at(self._rows), self.k_max) == 0:
            self.paused_for = self._pause_len
            self._pause_len = min(self.MAX_PAUSE, self._pause_len * 2)
            self.rate = max(self.rate, 0.5)   # the probe after the pause starts from a fair guess
        elif accepted == drafted:
            self._pause_len = self.PAUSE


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
