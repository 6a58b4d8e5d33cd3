"""A generation and an embedding as the worker holds them: the scheduling policy's view (steps.py's
Job, EmbedJob) plus the request's stream, sampler, text and speculative-decoding state."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..stream import GenerationStream
from ..reasoning import ChannelAssembler
from ..requests import GenerationRequest
from .steps import EmbedJob, Job


class GenJob(Job):
    """A generation: the policy's view (Job) plus the request's stream, sampler and text state."""

    def __init__(self, stream: GenerationStream, prompt_tokens: list[int], seed: int, asm: ChannelAssembler,
                 budget: int | None = None, grammar: str | None = None, units: dict[int, Any] | None = None):
        super().__init__(prompt_tokens, stream.request.priority, cancelled=lambda: stream.cancelled, units=units)
        self.stream = stream
        self.req: GenerationRequest = stream.request
        self.seed = seed
        self.sampler: Any = None   # made on the worker thread at the first sample
        #: where the sampler draws: "backend" or "cpu" (sampler_choice.py), chosen with the sampler
        self.sampler_kind: str | None = None
        self.n_gen = 0
        self.asm = asm
        #: reasoning tokens after which the block is closed (None: no limit)
        self.budget = budget
        #: the answer's grammar (GBNF), in the sampler chain once the answer channel has begun
        self.grammar = grammar
        self.grammar_live = False
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        #: speculative decoding: the drafter (None: none); its K policy is the policy's `Job.control`
        self.drafter: Any = None
        self.n_ctx_seq = 0

    def draft_room(self, rows: int = 1) -> int:
        """What the K policy asks for a step of `rows` sequences, within what the request can still
        use: no draft reaches past the context, max_tokens, max_total_tokens or the reasoning budget
        (the token that reaches a limit is the last one sampled anyway)."""
        if self.control is None:
            return 0
        asm, req = self.asm, self.req
        room = min(self.control.room(rows), self.n_ctx_seq - len(self.seq) - 1)
        if asm.split.answering or not asm.in_reasoning:
            room = min(room, req.max_tokens - asm.n_answer - 1)
        if req.max_total_tokens is not None:
            room = min(room, req.max_total_tokens - self.n_gen - 1)
        if asm.in_reasoning and self.budget is not None:
            room = min(room, self.budget - asm.n_reasoning - 1)
        return max(0, room)


@dataclass(eq=False)
class EmbedRequest(EmbedJob):
    normalize: bool = True
    out: np.ndarray | None = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    def end(self, error: BaseException | None = None) -> None:
        """Wake the caller waiting for the vectors: done (normalised if asked), or `error`."""
        if error is None and self.normalize and self.out is not None:
            self.out = self.out / np.maximum(np.linalg.norm(self.out, axis=1, keepdims=True), 1e-12)
        self.error = error
        self.finished.set()
