"""A sampled token's way to its request's stream, and the end of a request: the part of the model
worker (worker.py) that streams text, applies stop strings, limits and the reasoning budget, and
concludes results. Runs on the worker thread only."""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from . import imageprompt
from .. import reasoning
from ..engine import Vocab
from ..errors import InvalidRequest
from ..generation import NOT_A_TOKEN, TokenEvent
from ..reasoning import ChannelAssembler
from .jobs import GenJob
from .scheduler import Policy
from .seam import Backend


class Delivery:
    """Streams one model's sampled tokens and ends its requests.

    Built with the model's `name` (for results), `vocab` (token text, end of generation), `backend`
    (samplers to free, KV trims), the scheduling `policy` and the `lock` that guards it (an ended
    request leaves its slot), the `stats` counter, the tokens a sequence holds (`n_ctx_seq`) and
    `ended`, called as each request ends (the model's last use)."""

    def __init__(self, name: str, vocab: Vocab, backend: Backend, policy: Policy, lock: threading.Condition,
                 stats: collections.Counter, n_ctx_seq: int, ended: Callable[[], None]):
        self.name = name
        self.vocab = vocab
        self.backend = backend
        self.policy = policy
        self.lock = lock
        self.stats = stats
        self.n_ctx_seq = n_ctx_seq
        self.ended = ended

    def took(self, job: GenJob, tok: int, ent: float | None, now: float,
             lp: tuple[float, list[tuple[int, float]]] | None = None) -> None:
        """A sampled token: stream its text, and finish the request at EOG, a stop string or a limit."""
        if job.t_first is None:
            job.t_first = now
            self.stats["first_token_us"] += int((now - job.t_submit) * 1e6)   # submitted to first token
            self.stats["first_tokens"] += 1
        job.t_last = now
        job.n_gen += 1
        self.stats["generated_tokens"] += 1
        matcher = job.sampler.grammar if job.sampler is not None else None
        failed = matcher.error if matcher is not None else None
        if failed:   # the grammar's matcher gave up (grammar.py): this request ends, the others go on
            return self.fail(job, InvalidRequest(failed))
        if self.vocab.is_eog(tok):
            if ent is not None:
                job.asm.entropies.append(ent)
            return self.finish_slot(job, "stop")
        job.seq.append(tok)
        piece = self.vocab.piece(tok)
        # a control token renders as nothing; harmony's channel markers are such tokens
        markup = self.vocab.token_text(tok) if not piece and job.asm.format.name == reasoning.GPT_OSS else ""
        r, text = job.asm.add(piece, ent, markup)
        if lp is None:
            job.stream._emit(TokenEvent(text, tok, ent, reasoning=r))
        else:
            top = [(self.vocab.piece(t).decode("utf-8", "replace"), v) for t, v in lp[1]]
            job.stream._emit(TokenEvent(text, tok, ent, piece.decode("utf-8", "replace"), lp[0], top, reasoning=r))
        if job.asm.stopped:
            return self.finish_slot(job, "stop")
        if job.asm.in_reasoning and job.budget is not None and job.asm.n_reasoning >= job.budget:
            self.close_reasoning(job)
        if job.grammar is not None and not job.grammar_live and job.asm.split.answering and job.sampler is not None:
            self.backend.free_sampler(job.sampler)   # the next sample makes the chain with the grammar
            job.sampler = None
        total = job.req.max_total_tokens
        if job.asm.n_answer >= job.req.max_tokens or (total is not None and job.n_gen >= total) \
                or len(job.seq) >= self.n_ctx_seq:
            return self.finish_slot(job, "length")

    def end_tokens(self, asm: ChannelAssembler) -> list[int]:
        """The tokens of the template's end-of-thinking text."""
        return self.vocab.tokenize(asm.format.end_text, add_bos=False, special=True)

    def close_reasoning(self, job: GenJob) -> None:
        """The budget is spent: the template's end-of-thinking text goes into the sequence as prompt
        tokens (the next batched decode reads them with every other request's token; nothing else
        waits), and the model goes on with the answer."""
        job.seq.extend(self.end_tokens(job.asm))
        r, text = job.asm.close()
        self.stats["reasoning_budget_closed"] += 1
        if r or text:
            job.stream._emit(TokenEvent(text, NOT_A_TOKEN, None, reasoning=r))

    def fail(self, job: GenJob, error: BaseException, trim: bool = True) -> None:
        """`job` ends with `error`; its slot's cache goes (left as it is with `trim` False: a
        context that failed is not touched again)."""
        with self.lock:
            t = self.policy.release(job, keep_cache=False)
        if trim and t is not None:
            self.backend.trim(t.seq_id, t.position)
        self.finish(job, "error", error)

    def finish_slot(self, job: GenJob, reason: str) -> None:
        with self.lock:
            self.policy.release(job)
        self.finish(job, reason)

    def finish(self, job: GenJob, reason: str, error: BaseException | None = None) -> None:
        imageprompt.free_units(job.units)
        if job.sampler is not None:
            self.backend.free_sampler(job.sampler)
            job.sampler = None
        self.ended()
        self.stats[f"finished_{reason}"] += 1
        gen = job.seq[len(job.prompt_tokens):]
        job.stream._conclude(job.asm, reason, error, model=self.name, tokens=gen, n_tokens=len(gen),
                             n_prompt=len(job.prompt_tokens), n_cached=job.n_cached or 0, seed=job.seed,
                             t_first=job.t_first, t_last=job.t_last, drafted=job.drafted, accepted=job.accepted,
                             sampler=job.sampler_kind or "")
