"""Sampling a decode step's output rows and verifying drafts: the part of the model worker
(worker.py) that turns logits rows into tokens. Runs on the worker thread only."""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from . import sampler_choice
from ..engine import Vocab
from ..options import LoadSpec
from .jobs import GenJob
from .scheduler import Entry, Policy
from .seam import Backend


class RowVerifier:
    """Samples the output rows of one model's decode steps and verifies their drafts.

    Built with what it reads and nothing more: the `backend` (samplers, logits rows, KV trims), the
    `vocab` (end of generation), the scheduling `policy` and the `lock` that guards it (rejected
    drafts leave a slot), the model's LoadSpec `spec` (where samplers draw), its `stats` counter,
    and `took`: what becomes of a sampled token (the worker streams it and ends the request at a
    stop or a limit)."""

    def __init__(self, backend: Backend, vocab: Vocab, policy: Policy, lock: threading.Condition, spec: LoadSpec,
                 stats: collections.Counter, took: Callable[..., None]):
        self.backend = backend
        self.vocab = vocab
        self.policy = policy
        self.lock = lock
        self.spec = spec
        self.stats = stats
        self.took = took

    def verify(self, outs: list[Entry], now: float) -> None:
        """Sample every output row of the step, and verify drafts: round r samples row `output + r` of
        each entry still verifying, in order, with the request's own sampler (speculative.py says why
        that is exact); an entry goes on while its draw equals its r-th drafted token and nothing ended
        or changed the request (a stop, a limit, a closed reasoning block). Then the rejected drafts
        leave the KV cache."""
        slots = {id(e): e.job.slot for e in outs}
        matched = dict.fromkeys(map(id, outs), 0)
        made = dict.fromkeys(map(id, outs), 0)
        active, r = outs, 0
        while active:
            for e in active:
                if e.job.sampler is None:
                    self.sampler(e.job)
            t0 = time.perf_counter()
            sampled = self.backend.sample_rows([(e.job.sampler, e.output + r, e.job.req.confidence.enabled)
                                                for e in active])
            self.stats["sample_us"] += int((time.perf_counter() - t0) * 1e6)
            going = []
            for e, (tok, ent) in zip(active, sampled):
                job = e.job
                lp = None
                if job.req.logprobs is not None and not self.vocab.is_eog(tok):
                    lp = self.backend.logprobs(e.output + r, tok, job.req.logprobs)
                n_seq = len(job.seq)
                hit = r < len(e.draft) and tok == e.draft[r]
                if r == 0:
                    job.drafted += len(e.draft)
                if hit:   # counted before took: the result may be made there
                    matched[id(e)] += 1
                    job.accepted += 1
                self.took(job, tok, ent, now, lp)
                made[id(e)] += 1
                if hit and job.slot is not None and len(job.seq) == n_seq + 1:
                    going.append(e)
            active, r = going, r + 1
        for e in outs:
            if e.draft:
                with self.lock:
                    trim = self.policy.settle(e.job, slots[id(e)], matched[id(e)])
                if trim is not None:
                    self.backend.trim(trim.seq_id, trim.position)
                self.stats["drafted_tokens"] += len(e.draft)
                self.stats["accepted_tokens"] += matched[id(e)]
            if e.job.control is not None:
                e.job.control.record(len(e.draft), matched[id(e)], made[id(e)])

    def sampler(self, job: GenJob) -> None:
        """The request's sampler, made at its first output row (sampler_choice.py decides where it
        draws); a backend chain follows its request to the sequence it decodes in now, and a row
        drawn on the CPU has no other request's chain on its sequence (the backend's prepare)."""
        if job.sampler is None:
            if job.sampler_kind is None:
                job.sampler_kind, why = sampler_choice.choose(self.spec.backend_sampling,
                                                              self.backend.backend_sampling, job.req,
                                                              self.spec.draft_max, self.backend.backend_entropy)
                self.stats[f"sampler_{job.sampler_kind}"] += 1
            job.grammar_live = job.grammar is not None and job.asm.split.answering
            seq = job.slot.seq_id if job.sampler_kind == sampler_choice.BACKEND and job.slot is not None else None
            job.sampler = self.backend.new_sampler(job.req.sampling, job.seed,
                                                   job.grammar if job.grammar_live else None, seq_id=seq,
                                                   entropy=job.req.confidence.enabled)
            if seq is not None and not job.sampler.backend:
                job.sampler_kind = sampler_choice.CPU   # llama.cpp refused the chain
        if job.slot is not None:   # its chain follows it; a CPU row gets its logits
            self.backend.prepare(job.sampler, job.slot.seq_id, job.sampler_kind == sampler_choice.BACKEND)
