"""The scheduling policy: which request runs in which sequence slot, and what the next step decodes.

Plain Python with no llama.cpp (or any engine) call, so every decision is unit-tested
deterministically in milliseconds. The model worker (worker.py) asks this policy what to do, tells
its engine to do it (trim a slot's KV cache, decode a batch, embed a pack of texts) and reports back.
The split follows llama.cpp's server and nano-vllm: a scheduler that composes batches, a runner that
executes them.

Rules, in the order they apply:

* **Priorities.** Higher runs first. Editor requests are interactive (10), workflow generations and
  embeddings batch (0). Only the highest priority class decodes in a step, so a long workflow
  generation never slows an editor request beside it. A job's class is the priority it was
  submitted with (`base_priority`); promotion (below) does not change it.
* **Admission.** Waiting requests take free slots, highest class first, then oldest. A slot is
  chosen by the longest common prefix between its cached tokens and the request's prompt (KV reuse)
  where that prefix is most of the prompt, else empty first, then least recently used, weighed
  against keeping the running slots side by side (slots.py: llama.cpp decodes a step in one
  pass only over consecutive sequence ids); a step whose slots are not side by side first moves
  requests into the holes between them (`DecodeStep.moves`) where the engine can copy a slot.
  When every slot is taken, a waiting request may preempt (pause) a running one of a lower class;
  the paused request waits again and resumes later from what its slot still holds.
* **Batch composition.** Running sequences put in one token each, then prompt chunks share what is
  left of the batch budget, shortest remainder first (the step's rows then go in ascending slot
  order: slots.py); a prompt longer than the budget is read over
  several steps, so other requests keep decoding meanwhile. While editors are active (an
  interactive request in the last `interactive_window_s`), a lower-priority prompt is read at most
  `yield_tokens` at a time, so an editor request that arrives meanwhile waits for one small chunk
  (64 tokens: about 0.2 s on two CPU cores) instead of a full batch (256: about 0.8 s). Reading in
  64-token chunks costs about 10% of prompt speed on the CPU, so workflows alone keep full batches.
* **Units** (units.py: an image) are fed whole as embeddings, in an entry that takes no row of the
  token batch; text stops at a unit's start. A unit beyond the chunk size is still one unit (an editor
  waits for at most one); entries and trims carry positions (M-RoPE units take fewer than their tokens).
* **Speculation** (speculative.py) takes only the batch room left once every job has its share
  (`_grant_drafts`); riders beside editors draft nothing, and while editors are active batch work
  drafts at most `yield_tokens` a step: one small pack. Rejected drafts are trimmed (`settle`).
* **Embeddings** run one small pack of texts per step. Work of the same priority class takes turns
  (a pack, then a decode step); work of a lower class waits.
* **Editors wait for one small pack at most.** The class that runs is the highest among running,
  queued *and* embedding work: an interactive request that has no slot yet holds back batch work as
  much as one that is decoding, and it preempts any batch job (promoted or not) for a slot.
* **Nothing starves.** A batch job that has waited `promote_after_s` (10 s) for a slot or for a
  step is promoted for the rest of its run. With no interactive work around, a promoted job runs with
  the top class. Beside interactive work it is served without costing editors more than one small
  pack each: a promoted generation that is decoding adds its one token to the editors' steps (one
  more row of a decode batch); a promoted prompt chunk (at most `yield_tokens`) or embedding pack runs only
  while every interactive request waiting or running has not yet waited for batch work, and that
  wait is then spent (counting the batch step in flight when a request arrives). So every
  interactive request waits for at most one small pack of batch work, and batch work still advances
  with every editor request. When editors take every slot, batch generations wait for one to free.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..generation import PRIORITY_INTERACTIVE
from .slots import Slot, gather, placement_key
from .steps import Admission, DecodeStep, EmbedJob, EmbedStep, Entry, Job, Move, Trim

__all__ = ["Admission", "DecodeStep", "EmbedJob", "EmbedStep", "Entry", "Job", "Move", "Policy", "Slot", "Trim"]


class Policy:
    """Slots, the waiting queue and the embedding queue of one loaded model. Not thread-safe: the
    worker calls it under its own lock."""

    def __init__(self, n_slots: int, batch_tokens: int, embed_pack_tokens: int = 32, embed_pack_texts: int = 8,
                 yield_tokens: int = 64, interactive_window_s: float = 30.0, promote_after_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_rollback: int | None = None,
                 can_move: bool = False):
        if n_slots < 1 or batch_tokens < 1:
            raise ValueError("a policy needs at least one slot and one batch token")
        self.yield_tokens = yield_tokens
        self.interactive_window_s = interactive_window_s
        self.promote_after_s = promote_after_s
        self.promotions = 0
        self._clock = clock
        #: how many tokens a slot's cache can drop from its end; None: any number. A recurrent layer
        #: (qwen35's Gated DeltaNet) holds one state, not a cache per position: it steps back only
        #: as far as the snapshots the context keeps, so reusing a slot's prefix that ends earlier
        #: than its cached tokens is impossible there, and the slot starts over.
        self.max_rollback = max_rollback
        #: the engine copies a slot's cache into another (slots.compact closes holes between slots)
        self.can_move = can_move
        self.moves = 0
        self._last_interactive: float | None = None
        self.slots = [Slot(i) for i in range(n_slots)]
        self.batch_tokens = max(batch_tokens, n_slots)
        self.embed_pack_tokens = embed_pack_tokens
        self.embed_pack_texts = embed_pack_texts
        self.pending: list[Job] = []
        self.embeds: deque[EmbedJob] = deque()
        self._tick = itertools.count(1)
        self.preemptions = 0
        self._embed_turn = True
        #: the step handed out last holds a unit of batch work (a prompt chunk or an embedding pack)
        #: that has not been reported back: an interactive request arriving now waits for it
        self._batch_in_flight = False

    # -- queue ----------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        job.waiting_since = self._clock()
        if job.base_priority >= PRIORITY_INTERACTIVE:
            self._last_interactive = job.waiting_since
            job.batch_waited = self._batch_in_flight
        self.pending.append(job)

    def editors_active(self) -> bool:
        """An interactive request came within the last `interactive_window_s` seconds."""
        t = self._last_interactive
        return t is not None and self._clock() - t < self.interactive_window_s

    def submit_embed(self, job: EmbedJob) -> None:
        job.waiting_since = self._clock()
        if job.base_priority >= PRIORITY_INTERACTIVE:
            job.batch_waited = self._batch_in_flight
        self.embeds.append(job)

    def running(self) -> list[Job]:
        return [s.job for s in self.slots if s.job is not None]

    def busy(self) -> bool:
        return bool(self.pending or self.embeds or self.running())

    # -- admission ------------------------------------------------------------------------------
    def admit(self) -> Admission:
        """Place waiting jobs into slots (preempting lower priorities when all are taken)."""
        out = Admission()
        for job in [j for j in self.pending if j.is_cancelled()]:
            self.pending.remove(job)
            out.dropped.append(job)
        for ejob in [j for j in self.embeds if j.cancelled()]:
            self.embeds.remove(ejob)
            out.dropped_embeds.append(ejob)
        self._promote()
        self.pending.sort(key=lambda j: (-j.base_priority, j.id))
        while self.pending:
            job = self.pending[0]
            free = [s for s in self.slots if s.job is None]
            if not free:
                victims = [s for s in self.slots if s.job is not None and s.job.base_priority < job.base_priority]
                if not victims:
                    break
                # the lowest class, not promoted before promoted, newest first
                victim = min(victims, key=lambda s: (s.job.base_priority, s.job.promoted, -s.job.id))
                out.preempted.append(self._preempt(victim))
                free = [victim]
            self.pending.pop(0)
            if job.n_cached is None:
                out.first_placed.append(job)
            trim = self._place(job, free)
            if trim is not None:
                out.trims.append(trim)
        return out

    def _move(self, src: Slot, dst: Slot) -> Move:
        """`src`'s job goes on in `dst`, whose cache becomes a copy of `src`'s; `src` keeps its cache
        for a later request with the same prefix."""
        job = src.job
        dst.tokens = list(src.tokens)
        dst.job, src.job, job.slot = job, None, dst
        src.last_used = next(self._tick)
        self.moves += 1
        return Move(src.seq_id, dst.seq_id)

    def _promote(self) -> None:
        """Promote every job that has waited promote_after_s: queued, paused in a slot while higher
        classes decode, or an embedding not yet finished (a job that takes steps never has: each
        step restarts its clock)."""
        now = self._clock()
        for job in [*self.pending, *self.running(), *self.embeds]:
            if job.priority < PRIORITY_INTERACTIVE and now - job.waiting_since > self.promote_after_s:
                job.priority = PRIORITY_INTERACTIVE
                self.promotions += 1

    def _preempt(self, slot: Slot) -> Job:
        job = slot.job
        assert job is not None
        job.waiting_since = self._clock()
        job.slot = None
        slot.job = None
        slot.last_used = next(self._tick)
        self.pending.append(job)
        self.preemptions += 1
        return job

    def _place(self, job: Job, free: list[Slot]) -> Trim | None:
        running = {s.seq_id for s in self.slots if s.job is not None and s.job.base_priority == job.base_priority}
        best = max(free, key=lambda s: placement_key(s, common_prefix(s.tokens, job.seq), running, len(job.seq)))
        # keep at least one token to decode: its logits give the next token
        common = min(common_prefix(best.tokens, job.seq), len(job.seq) - 1)
        inside = job.units.covering(common) if job.units else None
        if inside is not None:   # a unit is cached whole or not at all
            common = inside[0]
        if self.max_rollback is not None and len(best.tokens) - common > self.max_rollback:
            common = 0           # the cache cannot step back that far: read the whole prompt again
        trim = None
        if common < len(best.tokens):
            trim = Trim(best.seq_id, common, job.position(common) if job.units else None)
            del best.tokens[common:]
        job.fed = common
        job.waiting_since = self._clock()   # from now on: time since its last step
        if job.n_cached is None:
            job.n_cached = min(common, len(job.prompt_tokens))
        job.slot = best
        best.job = job
        return trim

    def release(self, job: Job, keep_cache: bool = True) -> Trim | None:
        """Free the job's slot; its KV stays for a later request with the same prefix unless
        `keep_cache` is False (then the returned Trim clears it)."""
        slot = job.slot
        if slot is None:
            return None
        slot.job = None
        slot.last_used = next(self._tick)
        job.slot = None
        if keep_cache:
            return None
        slot.tokens.clear()
        return Trim(slot.seq_id, 0)

    # -- planning -------------------------------------------------------------------------------
    def cancelled_running(self) -> list[Job]:
        """Running jobs whose request was cancelled: release them before the next step."""
        return [j for j in self.running() if j.is_cancelled()]

    def next_step(self) -> DecodeStep | EmbedStep | None:
        """The next unit of work: a pack of texts to embed, a batch to decode, or nothing.

        The top class is the highest among running, queued and embedding work: its embeddings take
        turns with its decode steps, and lower classes wait unless promoted (see "Nothing starves"
        above)."""
        step = self._plan()
        self._batch_in_flight = step is not None and _holds_batch_unit(step)
        return step

    def _plan(self) -> DecodeStep | EmbedStep | None:
        embeds = [j for j in self.embeds if not j.cancelled()]   # cancelled ones leave at the next admit
        running = self.running()
        work: list[Job | EmbedJob] = [*running, *self.pending, *embeds]
        if not work:
            return None
        top = max(j.base_priority for j in work)
        editors = [j for j in work if j.base_priority >= PRIORITY_INTERACTIVE]

        def cls(j: Job | EmbedJob) -> int:   # alone, promoted batch work joins the top class
            return top if j.promoted and not editors else j.base_priority

        gens = [j for j in running if cls(j) == top and j.remaining > 0]
        top_embeds = [j for j in embeds if cls(j) == top]
        if top_embeds and (not gens or self._embed_turn):
            self._embed_turn = False
            return self._pack(min(top_embeds, key=lambda j: j.id))
        self._embed_turn = True
        if not editors:
            return self._decode(gens, top)
        low = [j for j in running if cls(j) < top and j.promoted and j.remaining > 0]
        riders = [j for j in low if j.remaining == 1]   # decoding: one token each
        granted: Job | EmbedJob | None = None
        if not any(j.batch_waited for j in editors):    # every editor may still wait for one unit
            units = [*(j for j in low if j.remaining > 1), *(j for j in embeds if cls(j) < top and j.promoted)]
            granted = min(units, key=lambda j: (j.waiting_since, j.id), default=None)
        if isinstance(granted, EmbedJob):
            step: DecodeStep | EmbedStep | None = self._pack(granted)
        else:
            step = self._decode(gens, top, riders, granted)
        if granted is not None and _holds_batch_unit(step):
            for j in editors:
                j.batch_waited = True
        return step

    def _pack(self, job: EmbedJob) -> EmbedStep:
        """The next texts of `job` that fit one pack (at least one text, however long)."""
        lists = job.token_lists
        first = job.done
        total, n = 0, 0
        while (first + n < len(lists) and n < self.embed_pack_texts
               and (n == 0 or total + len(lists[first + n]) <= self.embed_pack_tokens)):
            total += len(lists[first + n])
            n += 1
        return EmbedStep(job, first, n)

    def _decode(self, gens: list[Job], top: int, riders: list[Job] = (),
                granted: Job | None = None) -> DecodeStep | None:
        """`gens` (the top class) with their chunks, then `riders` with one token each, then at
        most `yield_tokens` of the `granted` job's prompt, as far as the batch budget goes."""
        budget = self.batch_tokens
        chunk = self.yield_tokens if top < PRIORITY_INTERACTIVE and self.editors_active() else budget
        plan = [(j, chunk) for j in sorted(gens, key=lambda j: (j.remaining, j.id))]
        plan += [(j, 1) for j in riders]
        if granted is not None:
            plan.append((granted, self.yield_tokens))
        entries: list[Entry] = []
        for job, limit in plan:
            take = min(job.remaining, budget, limit)
            if take <= 0:
                break
            unit = None
            if job.units:
                take, unit = job.units.segment(job.fed, take)
                if unit is not None and entries and take > budget:
                    continue   # a unit larger than what is left of this step: whole, in a later one
            e = Entry(job, job.fed, take, pos=job.position(job.fed) if job.units else None, unit=unit)
            if unit is None and take == job.remaining:   # a unit is decoded apart: no row, no logits
                e.output = 0
            entries.append(e)
            job.took = take
            budget -= take
        if not entries:
            return None
        moves = []
        if self.can_move:   # llama.cpp decodes consecutive ids in one pass (slots.py)
            together = {e.job.slot.seq_id for e in entries if e.unit is None}
            moves = [self._move(src, dst) for src, dst in gather(self.slots, together)]
        entries.sort(key=lambda e: e.job.slot.seq_id)   # rows in ascending sequence id
        self._grant_drafts(entries, gens, budget, top)
        step = DecodeStep(entries, moves)
        step.number_rows()
        return step

    def _grant_drafts(self, entries: list[Entry], gens: list[Job], budget: int, top: int) -> None:
        """Speculative decoding takes only what the batch has left once every planned job has its
        share, the higher class first, then the oldest; riders beside editors draft nothing, and
        while editors are active the batch class drafts at most `yield_tokens` a step in all."""
        if top < PRIORITY_INTERACTIVE and self.editors_active():
            budget = min(budget, self.yield_tokens)
        top_jobs = set(map(id, gens))
        rows = sum(1 for e in entries if e.output is not None and e.count == 1)
        for e in sorted(entries, key=lambda e: (-e.job.priority, e.job.id)):
            if budget <= 0:
                break
            if e.output is None or e.count != 1 or id(e.job) not in top_jobs:
                continue
            e.room = max(0, min(e.job.draft_room(rows), budget))
            budget -= e.room

    def settle(self, job: Job, slot: Slot | None, accepted: int) -> Trim | None:
        """After a step with drafts: `accepted` of `job`'s drafted tokens are its own now, the rest
        leave its slot. `slot`: where the step decoded it (released meanwhile: its cache stays as is)."""
        if slot is None or job.slot is not slot:
            return None
        job.fed += accepted
        if len(slot.tokens) <= job.fed:
            return None
        del slot.tokens[job.fed:]
        return Trim(slot.seq_id, job.fed, job.position(job.fed) if job.units else None)

    def embedded(self, step: EmbedStep) -> bool:
        """Record a finished pack; True when the job has embedded all its texts."""
        self._batch_in_flight = False
        step.job.done = step.first + step.count
        step.job.waiting_since = self._clock()
        if step.job.done >= len(step.job.token_lists):
            if step.job in self.embeds:
                self.embeds.remove(step.job)
            return True
        return False

    def drop_embed(self, job: EmbedJob) -> None:
        if job in self.embeds:
            self.embeds.remove(job)

    def aborted(self, step: DecodeStep) -> None:
        """The engine stopped `step` (a request in it was cancelled): nothing of it is in the caches;
        the others take it again in the next step."""
        self._batch_in_flight = False

    def decoded(self, step: DecodeStep) -> None:
        """Record a successful decode: the step's tokens are now in their slots' KV caches."""
        self._batch_in_flight = False
        now = self._clock()
        for e in step.entries:
            job = e.job
            if job.slot is not None:
                job.slot.tokens.extend(e.tokens())
            job.fed += e.count
            job.took = 0
            job.waiting_since = now

    def drain(self) -> tuple[list[Job], list[EmbedJob]]:
        """Everything still queued or running (at shutdown); the policy is empty afterwards."""
        jobs = self.running() + self.pending
        for s in self.slots:
            s.job = None
        for j in jobs:
            j.slot = None
        self.pending.clear()
        embeds = list(self.embeds)
        self.embeds.clear()
        return jobs, embeds


def _holds_batch_unit(step: DecodeStep | EmbedStep | None) -> bool:
    """Whether `step` holds a unit of batch work: an embedding pack, or a prompt chunk (a decoding
    token is not one: it adds a row to a batch that runs anyway)."""
    if isinstance(step, EmbedStep):
        return step.job.base_priority < PRIORITY_INTERACTIVE
    return step is not None and any(e.job.base_priority < PRIORITY_INTERACTIVE and (e.count > 1 or e.room > 0)
                                    for e in step.entries)


def common_prefix(a: list[Any], b: list[Any]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
