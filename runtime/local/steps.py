"""What the scheduling policy (scheduler.py) hands the worker: the KV trims, the decode step with each
job's entry (tokens, positions, logits rows, drafts), the embedding pack, and what admission decided.
Plain data; the jobs they name are scheduler.py's Job and EmbedJob."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .scheduler import EmbedJob, Job


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
