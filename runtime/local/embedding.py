"""A model's embedding path: texts become token ids checked against the embedding context, the
request waits in the scheduling policy's embedding queue, and the worker thread embeds it one small
pack of texts per step (scheduler.py chooses the packs), so a cancel or an interactive request
waits for one pack at most."""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

import numpy as np

from ..engine import Embedded, Vocab
from ..errors import InvalidRequest, PromptTooLong
from .jobs import EmbedRequest
from .scheduler import EmbedStep, Policy
from .seam import Backend


class Embedder:
    """Embeds texts for one model.

    Built with the model's `vocab`, its `backend` (which embeds a pack), the scheduling `policy` and
    the `lock` that guards it, the `stats` counter, the tokens a text may have (`n_ctx`, the
    LoadSpec's embed_n_ctx), the vectors' width `n_embd`, and `queue`, which runs a function that
    puts a job into the policy under the lock unless the model is closing (ModelUnloaded), then
    wakes the worker. Callers on any thread call `embed`; the worker thread calls `run`."""

    def __init__(self, vocab: Vocab, backend: Backend, policy: Policy, lock: threading.Condition,
                 stats: collections.Counter, n_ctx: int, n_embd: int, queue: Callable[[Callable[[], None]], None]):
        self.vocab = vocab
        self.backend = backend
        self.policy = policy
        self.lock = lock
        self.stats = stats
        self.n_ctx = n_ctx
        self.n_embd = n_embd
        self.queue = queue

    def embed(self, texts: Sequence[str], *, pooling: str = "mean", normalize: bool = True, priority: int = 0,
              cancelled: Callable[[], bool] | None = None) -> Embedded:
        v = self.vocab
        lists = [v.tokenize(t, add_bos=v.add_bos, special=False) for t in texts]
        return Embedded(self.embed_tokens(lists, pooling=pooling, normalize=normalize, priority=priority,
                                          cancelled=cancelled), sum(map(len, lists)))

    def embed_tokens(self, token_lists: list[list[int]], pooling: str = "mean", normalize: bool = True,
                     priority: int = 0, timeout: float | None = None,
                     cancelled: Callable[[], bool] | None = None) -> np.ndarray:
        """Pooled embeddings of texts given as token ids, one row per text (see `embed`)."""
        for i, toks in enumerate(token_lists):   # what the texts are was checked by the runtime (embed_texts)
            if not toks:
                raise InvalidRequest(f"Text #{i} gives no tokens; embeddings need at least one.")
            if len(toks) > self.n_ctx:
                raise PromptTooLong(f"Text #{i} has {len(toks)} tokens; embeddings take at most "
                                    f"{self.n_ctx} per text. Split it into chunks, or load "
                                    "the model with a larger embed_n_ctx.")
        job = EmbedRequest(token_lists, pooling, priority, cancelled or (lambda: False), normalize=normalize)
        job.out = np.zeros((len(token_lists), self.n_embd), dtype=np.float32)
        self.queue(lambda: self.policy.submit_embed(job))
        if not job.finished.wait(timeout):
            raise TimeoutError("embedding still running")
        if job.error is not None:
            raise job.error
        assert job.out is not None
        return job.out

    def run(self, step: EmbedStep) -> None:
        """On the worker thread: embed the step's pack; the caller wakes once its last pack is in."""
        job = step.job
        assert isinstance(job, EmbedRequest) and job.out is not None
        try:
            lists = job.token_lists[step.first:step.first + step.count]
            job.out[step.first:step.first + step.count] = self.backend.embed(lists, job.pooling)
        except BaseException as e:  # noqa: BLE001 - the waiting caller gets the error; the worker keeps serving
            with self.lock:
                self.policy.drop_embed(job)
            job.end(e)
            return
        self.stats["embedded_texts"] += step.count
        self.stats["embedded_tokens"] += sum(len(t) for t in lists)
        with self.lock:
            complete = self.policy.embedded(step)
        if complete:
            job.end()
