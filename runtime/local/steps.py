"""What the scheduling policy (scheduler.py) works on and hands the worker: the jobs as it sees them
(Job, EmbedJob), the KV trims, the decode step with each job's entry (tokens, positions, logits rows,
drafts), the embedding pack, and what admission decided. Plain data."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..generation import PRIORITY_BATCH
from .units import Units

if TYPE_CHECKING:
    from .slots import Slot

_job_ids = itertools.count(1)


class Job:
    """A generation as the policy sees it: its tokens, priority and where its KV cache stands.

    `seq` is the prompt followed by the generated tokens; `fed` counts the tokens of `seq` whose KV
    is in the slot. The worker keeps its own per-request state (stream, sampler) beside these fields.
    """

    def __init__(self, prompt_tokens: list[int], priority: int = PRIORITY_BATCH,
                 cancelled: Callable[[], bool] = lambda: False, units: dict[int, Any] | None = None):
        self.id = next(_job_ids)
        self.priority = priority           # raised to PRIORITY_INTERACTIVE when the job is promoted
        self.base_priority = priority
        self.waiting_since = 0.0           # clock time it last went waiting (queued, or paused)
        self.prompt_tokens = list(prompt_tokens)
        self.seq = list(prompt_tokens)
        self.fed = 0
        self.took = 0
        self.slot: Slot | None = None
        self.n_cached: int | None = None   # prompt tokens found in the slot's cache at first placement
        self.is_cancelled = cancelled
        self.batch_waited = False          # an interactive job: it has had its one wait for batch work
        #: units of the prompt fed as embeddings: {index in seq: unit with n_tokens and n_pos}
        self.units = Units(units)
        self.drafted = 0                   # speculative decoding: tokens drafted, and accepted
        self.accepted = 0
        #: its K policy (speculative.SpecControl) where it drafts, else None (drafting.even reads it)
        self.control: Any = None

    def position(self, index: int) -> int:
        """The position of `seq[index]` (units.py)."""
        return self.units.position(index)

    def draft_room(self, rows: int = 1) -> int:
        """Tokens this job would like to draft beside its next token in a step of `rows` sequences
        (speculative decoding; 0: none)."""
        return 0

    @property
    def promoted(self) -> bool:
        return self.priority > self.base_priority

    @property
    def remaining(self) -> int:
        """Tokens of `seq` not yet in the KV cache."""
        return len(self.seq) - self.fed

    def __repr__(self) -> str:
        return f"Job({self.id}, prio={self.priority}, fed={self.fed}/{len(self.seq)})"


@dataclass
class EmbedJob:
    """Texts (as token lists) to embed; `done` counts the texts already embedded."""

    token_lists: list[list[int]]
    pooling: str
    priority: int = PRIORITY_BATCH
    cancelled: Callable[[], bool] = lambda: False
    done: int = 0
    id: int = field(default_factory=lambda: next(_job_ids))
    waiting_since: float = 0.0
    batch_waited: bool = False

    def __post_init__(self) -> None:
        self.base_priority = self.priority   # raised `priority` = promoted, as for Job

    @property
    def promoted(self) -> bool:
        return self.priority > self.base_priority


@dataclass
class Trim:
    """Drop a slot's KV cache from position `keep` on (`keep=0`: all of it)."""

    seq_id: int
    keep: int
    #: the position `keep` stands at, where it differs (units with fewer positions than tokens)
    pos: int | None = None

    @property
    def position(self) -> int:
        return self.keep if self.pos is None else self.pos


@dataclass
class Move:
    """Copy slot `src`'s KV cache into slot `dst` (its own cache goes); the job goes on in `dst`."""

    src: int
    dst: int


@dataclass
class Entry:
    """One job's share of a decode step: tokens `job.seq[start:start + count]` at their positions.

    `output` is the row of the step's logits for the job's last token when the step ends its prompt
    (or it is decoding), else None: only those rows are sampled. A decoding job may also carry
    `draft`: tokens proposed after its last one (at most `room`, which the policy grants), decoded
    in the same step at the following positions, with logits rows `output + 1 ...` to verify them.
    """

    job: Job
    start: int
    count: int
    output: int | None = None
    #: the position of the first token (None: `start`)
    pos: int | None = None
    #: a unit fed as embeddings (an image) instead of token ids
    unit: Any = None
    room: int = 0
    draft: list[int] = field(default_factory=list)

    @property
    def position(self) -> int:
        return self.start if self.pos is None else self.pos

    def tokens(self) -> list[int]:
        return self.job.seq[self.start:self.start + self.count] + self.draft


@dataclass
class DecodeStep:
    entries: list[Entry]
    #: slots to copy before the decode (the policy brought the step's slots side by side)
    moves: list[Move] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(e.count + len(e.draft) for e in self.entries)

    def number_rows(self) -> None:   # once drafts are in: each entry's rows follow the previous one's
        row = 0
        for e in self.entries:
            if e.unit is not None:   # a unit is decoded apart: it takes no row
                continue
            row += e.count + len(e.draft)
            if e.output is not None:
                e.output = row - 1 - len(e.draft)


@dataclass
class EmbedStep:
    job: EmbedJob
    first: int          # index of the first text of this pack
    count: int


@dataclass
class Admission:
    """What `admit` decided: trims to apply before the next decode, and jobs that left the queue."""

    trims: list[Trim] = field(default_factory=list)
    dropped: list[Job] = field(default_factory=list)      # cancelled while waiting: finish them
    dropped_embeds: list[EmbedJob] = field(default_factory=list)   # likewise
    preempted: list[Job] = field(default_factory=list)    # paused, back in the queue
    first_placed: list[Job] = field(default_factory=list) # placed for the first time (n_cached is set)
