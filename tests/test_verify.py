"""The row verifier (runtime/local/verify.py) alone: built with its parts over the fake backend
(fakeengine.py), with no model worker, no thread and no store around it. It samples a step's output
rows, keeps a request's drafted tokens while its own draws match them, and trims the rest from the
sequence's cache."""
from __future__ import annotations

import collections
import threading

from fakeengine import DEFAULT_TEXT, OFFSET, FakeBackend, FakeSettings, FakeWeights

from comfyui_a3b.runtime.generation import preset
from comfyui_a3b.runtime.local.jobs import GenJob
from comfyui_a3b.runtime.local.scheduler import Policy
from comfyui_a3b.runtime.local.verify import RowVerifier
from comfyui_a3b.runtime.options import LoadSpec
from comfyui_a3b.runtime.requests import GenerationRequest, TextPrompt
from comfyui_a3b.runtime.stream import GenerationStream

TEXT = [OFFSET + b for b in DEFAULT_TEXT.encode()]   # what the fake writes, token by token


class Parts:
    """A verifier over a fake backend, the policy and a `took` that records each sampled token."""

    def __init__(self):
        self.spec = LoadSpec("fake://rows", n_ctx=256, n_parallel=1, n_batch=64)
        w = FakeWeights(self.spec, FakeSettings.parse(self.spec.path))
        self.vocab = w.vocab
        self.backend = FakeBackend(w, self.spec)
        self.policy = Policy(1, 64)
        self.stats: collections.Counter = collections.Counter()
        self.took: list[int] = []
        self.rows = RowVerifier(self.backend, self.vocab, self.policy, threading.Condition(), self.spec,
                                self.stats, self.take)

    def take(self, job, tok, ent, now, lp=None) -> None:
        self.took.append(tok)
        job.seq.append(tok)

    def job(self) -> GenJob:
        req = GenerationRequest(TextPrompt("Hi"), max_tokens=50, sampling=preset("greedy"))
        job = GenJob(GenerationStream(req), self.vocab.tokenize("Hi"), seed=0, asm=None)
        self.policy.submit(job)
        self.policy.admit()
        return job

    def step(self, draft: list[int] = ()) -> None:
        """Plan, decode and verify one step; `draft`: tokens proposed after the job's last one."""
        step = self.policy.next_step()
        e = step.entries[0]
        if draft:
            e.draft = list(draft)
            step.number_rows()
        self.backend.decode(step)
        self.policy.decoded(step)
        self.rows.verify([e for e in step.entries if e.output is not None], 0.0)


def test_a_verifier_alone_samples_each_row_and_keeps_only_matching_drafts():
    p = Parts()
    job = p.job()
    p.step()                                      # the prompt: its last row gives the first token
    assert p.took == TEXT[:1] and job.sampler is not None and p.stats["sampler_cpu"] == 1
    n = len(job.seq)
    p.step(draft=TEXT[1:4])                       # three right drafts: all kept, and the token after them
    assert p.took == TEXT[:5]
    assert (job.drafted, job.accepted) == (3, 3) and p.stats["accepted_tokens"] == 3
    assert p.backend.kv[0] == job.seq[:job.fed] and job.fed == n + 3
    p.step(draft=[TEXT[5], OFFSET + ord("#"), TEXT[7]])   # the second draft is wrong: the model's own token there
    assert p.took == TEXT[:7]
    assert (job.drafted, job.accepted) == (6, 4)
    assert p.backend.kv[0] == job.seq[:job.fed] and len(job.seq) == job.fed + 1   # the rejected drafts left the cache
    assert p.stats["drafted_tokens"] == 6
