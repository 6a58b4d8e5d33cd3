"""A model run in this process: its weights, its engine backend, and the one worker thread that drives both.

`LoadedModel` is the in-process engines' `Model` (engine.py): it turns a request's typed prompt into
token ids on the caller's thread (a chat rendered with the model's template, an infill prompt
built by fim.py, text tokenized) and schedules them token by token over a `Backend`.

Engine contexts are not thread-safe, so each `LoadedModel` has one worker thread, the only caller of
its backend. Callers on any thread submit generations (and get a `GenerationStream` back) or
embeddings (and wait for the vectors). The worker loop is short: ask the scheduling policy
(scheduler.py) what to do, apply its KV trims, run the step on the backend (a batch to decode, or a
pack of texts to embed), then sample each finished row, stream the text and finish requests.
Cancellation is checked between steps, so a cancelled or unloaded request stops between two tokens
and an embedding between two packs.

The worker holds its parts, each built with what it uses: `rows` (verify.py) samples a step's
output rows and verifies drafts, `out` (delivery.py) streams each sampled token and ends requests,
`embedder` (embedding.py) is the embedding path. `LoadedModel.open`, the engines' open path,
attaches what the model drafts with (draftmodel.py).
"""
from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import imageprompt, prompting
from .. import fim, reasoning, thinking
from ..models import memory
from ..engine import Embedded, Model
from .seam import Backend, DecodeAborted, DecodeFailed, LocalWeights
from ..errors import Cancelled, InvalidRequest, ModelLoadFailed, ModelUnloaded, PromptTooLong
from ..generation import TokenEvent
from ..stream import GenerationStream
from ..reasoning import ChannelAssembler
from ..options import LoadSpec
from ..requests import ChatPrompt, GenerationRequest, Prompt
from .delivery import Delivery
from .embedding import Embedder
from .jobs import GenJob
from .scheduler import Admission, DecodeStep, EmbedStep, Policy
from .speculative import StepCost
from . import drafting, draftmodel
from .verify import RowVerifier

log = logging.getLogger("a3b.worker")


class LoadedModel(Model):
    """Weights + backend (contexts for one LoadSpec) + the worker thread: the Model of an in-process
    engine. Beyond the Model interface, `vocab` (the tokenizer), `prompt_tokens` and `render_chat`
    show what a prompt becomes for this model. Its worker thread runs the step loop; the tokens a
    step samples go through `rows` (verify.py) and on to `out` (delivery.py)."""

    runs_here = True

    def __init__(self, weights: LocalWeights, backend: Backend, spec: LoadSpec):
        self.features: dict[str, Any] = {}
        self.weights = weights
        self.info = weights.info
        self.vocab = weights.vocab
        self.backend = backend
        self.spec = spec
        self.name = self.info.name
        self.n_ctx_seq = backend.n_ctx_seq
        if backend.vision is not None:
            self.features["vision"] = True
            if backend.vision.info is not None:
                self.features["projector"] = Path(backend.vision.info.path).name
        self.policy = Policy(spec.n_parallel, spec.n_batch, backend.embed_pack_tokens, backend.embed_pack_texts,
                             max_rollback=backend.max_rollback, can_move=backend.can_move)
        #: what a decode step costs here, per extra token (speculative decoding chooses K by it)
        self.step_cost = StepCost()
        #: what this model drafts with (draftmodel.py), attached as it opens (`open`); None: none
        self.draft_source: Any = None
        self._lock = threading.Condition()
        self._step: DecodeStep | None = None   # the decode step planned last (for interrupts)
        self._closing: str | None = None
        self.closed = threading.Event()
        self.stats: collections.Counter = collections.Counter()
        if backend.passes is not None:   # the engine counts its passes through the model into the stats
            backend.passes.stats = self.stats
        self.created = time.time()
        self.last_used = time.monotonic()
        #: a sampled token's way to its stream, and the end of requests
        self.out = Delivery(self.name, self.vocab, backend, self.policy, self._lock, self.stats, self.n_ctx_seq,
                            self._used)
        #: sampling a step's output rows, verifying drafts
        self.rows = RowVerifier(backend, self.vocab, self.policy, self._lock, spec, self.stats, self.out.took)
        #: the embedding path
        self.embedder = Embedder(self.vocab, backend, self.policy, self._lock, self.stats, spec.embed_n_ctx,
                                 self.info.n_embd, self._queue)
        self._thread = threading.Thread(target=self._run, name=f"a3b-worker-{self.name}", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, weights: LocalWeights, backend: Backend, spec: LoadSpec,
             models: Callable[[LoadSpec], Model]) -> LoadedModel:
        """The in-process engines' open path: the model, with what its `speculative` setting drafts
        with attached (a draft model got through `models`, as an entry of its own in the model
        store, or its own MTP layers). One that cannot draft so is closed again (InvalidRequest)."""
        model = cls(weights, backend, spec)
        try:
            draftmodel.attach(model, models)
        except BaseException:
            model.close("its draft model could not be used")
            raise
        return model

    # -- public, any thread ------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._closing and not self.closed.is_set()

    def _used(self) -> None:
        self.last_used = time.monotonic()

    @property
    def supports_fim(self) -> bool:
        return fim.fim_ids(self.vocab) is not None

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return self.vocab.tokenize(text, add_bos=add_bos, special=special)

    @property
    def vision(self) -> Any:
        """The projector that lets the model see images (llama/vision.py), or None."""
        return self.backend.vision

    def render_chat(self, prompt: ChatPrompt, messages: list | None = None) -> str:
        """The chat as the prompt text the model reads (its own template, or the named one); images
        as the projector's marker."""
        return prompting.render_chat(self, prompt, messages)

    def prompt_tokens(self, prompt: Prompt, max_tokens: int = 0) -> list[int]:
        """The token ids `prompt` becomes for this model (an infill prompt fitted beside
        `max_tokens`), as submit feeds them."""
        tokens, _, units = prompting.prompt(self, prompt, max_tokens)
        imageprompt.free_units(units)
        return tokens

    def count_tokens(self, prompt: Prompt, *, exact: bool = True) -> int:
        return len(self.prompt_tokens(prompt))

    def submit(self, request: GenerationRequest,
               on_token: Callable[[TokenEvent], None] | None = None) -> GenerationStream:
        request.validate()
        how = thinking.plan(self.info.chat_template, request)
        grammar = self.backend.compile_grammar(request.json_schema, request.grammar, request.abandoned) \
            if request.json_schema is not None or request.grammar is not None else None
        tokens, text, units = prompting.prompt(self, how.prompt, request.max_tokens)
        try:
            return self._submit(request, on_token, how, grammar, tokens, text, units)
        except BaseException:
            imageprompt.free_units(units)
            raise

    def _submit(self, request, on_token, how, grammar, tokens, text, units) -> GenerationStream:
        asm = ChannelAssembler(how.format, request.stop, request.confidence,
                               reasoning.start_state(how.format, text), request.n_indent)
        if asm.in_reasoning and how.budget == 0:   # opened by the template, closed before a token
            tokens = tokens + self.out.end_tokens(asm)
            asm.close()
        if not tokens:
            raise InvalidRequest("The prompt tokenizes to nothing; give some text to continue.")
        if len(tokens) >= self.n_ctx_seq:
            raise PromptTooLong(f"The prompt has {len(tokens)} tokens but the context holds {self.n_ctx_seq} "
                                "(including the answer). Shorten the prompt or load the model with a larger n_ctx.")
        n_vocab = self.info.n_vocab
        covered = {i for start, u in units.items() for i in range(start, start + u.n_tokens)}
        if len(tokens) - 1 in covered:
            raise InvalidRequest("The prompt ends with an image; the model needs text after it (the chat "
                                 "template's generation prompt).")
        bad = [t for i, t in enumerate(tokens) if not 0 <= t < n_vocab and i not in covered]
        if bad:
            raise InvalidRequest(f"Token ids outside the vocabulary (0..{n_vocab - 1}): {bad[:5]}")
        stream = GenerationStream(request, on_token)
        for w in how.warnings:
            log.warning("%s: %s", self.name, w)
        stream.warnings = how.warnings
        sp = request.sampling
        job = GenJob(stream, tokens, sp.seed if sp.seed is not None else random.randrange(2**32), asm, how.budget,
                     grammar, units)
        if units:
            self.stats["images"] += len(units)
        job.n_ctx_seq = self.n_ctx_seq
        # no drafts over a prompt with images: its placeholder ids are no tokens a drafter may propose
        job.drafter, job.control = (None, None) if units else drafting.for_request(self, request)
        stream.add_cancel_callback(lambda: self._cancelled(job))

        def put() -> None:
            self.policy.submit(job)
            self.stats["submitted"] += 1
        self._queue(put)
        return stream

    def _cancelled(self, job: GenJob) -> None:
        """From the cancelling thread: a decode reading `job`'s prompt (or image) stops now instead of
        at its end; a step of single tokens ends as it would (the worker drops the job after it)."""
        with self._lock:
            if self._step is not None and any(e.job is job and (e.count > 1 or e.unit is not None)
                                              for e in self._step.entries):
                self.backend.interrupt(True)
            self._lock.notify()

    def embed(self, texts: Sequence[str], *, pooling: str = "mean", normalize: bool = True, priority: int = 0,
              cancelled: Callable[[], bool] | None = None) -> Embedded:
        return self.embedder.embed(texts, pooling=pooling, normalize=normalize, priority=priority, cancelled=cancelled)

    def embed_tokens(self, token_lists: list[list[int]], pooling: str = "mean", normalize: bool = True,
                     priority: int = 0, timeout: float | None = None,
                     cancelled: Callable[[], bool] | None = None) -> np.ndarray:
        """Pooled embeddings of texts given as token ids, one row per text (see `embed`)."""
        return self.embedder.embed_tokens(token_lists, pooling, normalize, priority, timeout, cancelled)

    def _queue(self, put: Callable[[], None]) -> None:
        """Run `put` (a job into the policy) under the lock unless the model is closing; wake the worker."""
        with self._lock:
            if self._closing:
                raise ModelUnloaded(f"{self.name} is being unloaded ({self._closing}); load it again.")
            put()
            self._lock.notify()

    def busy(self) -> bool:
        with self._lock:
            return self.policy.busy()

    def wake(self) -> None:
        """Re-check cancellations now (a caller cancelled a request that is still waiting)."""
        with self._lock:
            self._lock.notify()

    def close(self, reason: str = "unloaded", wait: bool = True) -> None:
        """Stop: running and queued requests fail with ModelUnloaded, then the backend is closed."""
        with self._lock:
            if not self._closing:
                self._closing = reason
            self._lock.notify()
        if wait and threading.current_thread() is not self._thread:
            self.closed.wait()

    # -- worker ----------------------------------------------------------------------------------
    def _run(self) -> None:
        idle = False
        try:
            while True:
                with self._lock:
                    if not self._closing and not self.policy.busy():
                        idle = True
                    while not self._closing and not self.policy.busy():
                        if idle:
                            idle = False
                            self._lock.release()
                            try:   # work just ended: give the buffers it freed back to the OS
                                self.backend.idle()
                                memory.release()
                            finally:
                                self._lock.acquire()
                            continue
                        self._lock.wait()
                    if self._closing:
                        break
                    t_step = time.perf_counter()
                    adm = self.policy.admit()
                    for job in self.policy.cancelled_running():
                        adm.dropped.append(job)
                        self.policy.release(job)
                    step = self.policy.next_step()
                    # a request cancelled from now on stops this step where it reads its prompt
                    self._step = step if isinstance(step, DecodeStep) else None
                    self.backend.interrupt(False)
                self._apply(adm)
                if isinstance(step, DecodeStep):
                    drafting.fill(step)
                memory.release(busy=True)   # rate-limited: a few ms every half minute
                if isinstance(step, EmbedStep):
                    self.embedder.run(step)
                elif isinstance(step, DecodeStep):
                    self._decode(step)
                    self.stats["step_us"] += int((time.perf_counter() - t_step) * 1e6)
                elif not (adm.dropped or adm.dropped_embeds):
                    with self._lock:   # nothing runnable yet: do not spin
                        self._lock.wait(0.05)
        except BaseException as e:  # never leave callers hanging
            log.exception("worker of %s crashed", self.name)
            self._closing = self._closing or f"worker error: {e}"
        finally:
            self._shutdown()

    def _apply(self, adm: Admission) -> None:
        for trim in adm.trims:
            self.backend.trim(trim.seq_id, trim.position)
        self.stats["preempted"] += len(adm.preempted)
        self.stats["promoted"] = self.policy.promotions
        for job in adm.dropped:
            if isinstance(job, GenJob):
                self.out.finish(job, "cancelled")
        for ej in adm.dropped_embeds:
            ej.end(Cancelled("Embedding cancelled."))
        for job in adm.first_placed:
            self.stats["prompt_tokens"] += len(job.prompt_tokens)
            self.stats["cached_prompt_tokens"] += job.n_cached or 0

    def _encode_images(self, step: DecodeStep) -> None:
        """Encode the step's images before its decode (or find them in the projector's cache); a
        request whose image fails ends with that error, the others go on. A request cancelled while
        it waited for its turn is not encoded for."""
        for e in [e for e in step.entries if e.unit is not None]:
            if e.job.is_cancelled():
                step.entries.remove(e)
                continue
            try:
                self.vision.embedding(e.unit)
            except Exception as err:  # noqa: BLE001 - the request gets the error, the worker goes on
                step.entries.remove(e)
                self.out.fail(e.job, err)

    def _decode(self, step: DecodeStep) -> None:
        for move in step.moves:
            self.backend.move(move.src, move.dst)
        self.stats["moved"] += len(step.moves)
        if any(e.unit is not None for e in step.entries):
            self._encode_images(step)
            if not step.entries:
                with self._lock:
                    self.policy.decoded(step)
                return
        # a backend chain draws in the decode itself: it is made (or moved) before it
        for e in step.entries:
            if e.output is not None and e.job.slot is not None:
                self.rows.sampler(e.job)
        t0 = time.perf_counter()
        try:
            self.backend.decode(step)
        except DecodeAborted:   # a request in it was cancelled: the others take the step again
            with self._lock:
                self.policy.aborted(step)
            self.stats["aborted_steps"] += 1
            return
        except DecodeFailed as e:
            msg = f"{e}" + ("; the model is reloaded for the next request" if e.fatal else "")
            for entry in step.entries:   # one error each: it carries the job's partial
                self.out.fail(entry.job, ModelLoadFailed(msg), trim=not e.fatal)
            if e.fatal:   # the other requests end too (ModelUnloaded); the store loads anew
                log.error("%s: %s; closing the model, it loads again on its next request", self.name, e)
                with self._lock:
                    self._closing = self._closing or f"decode failed: {e}"
            return
        took = time.perf_counter() - t0
        if all(e.count == 1 for e in step.entries):   # decoding rows (and drafts), no prompt chunk
            self.step_cost.record(step.n_tokens, len(step.entries), took)
        with self._lock:
            self.policy.decoded(step)
        self.stats["decode_calls"] += 1
        self.stats["decoded_tokens"] += step.n_tokens
        self.stats["decode_us"] += int(took * 1e6)   # the engine's time (benchmarks: ms per step)
        self.stats["decode_rows"] += len(step.entries)
        outs = [e for e in step.entries if e.output is not None]
        if not outs:   # a prompt chunk alone: the next step may be launched while the GPU still works
            return
        t1 = time.perf_counter()
        self.backend.synchronize()   # the GPU's share of the step (benchmarks: where a step goes)
        now = time.perf_counter()
        self.stats["wait_us"] += int((now - t1) * 1e6)
        self.rows.verify(outs, now)
        self.stats["verify_us"] += int((time.perf_counter() - now) * 1e6)

    # -- shutdown --------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        reason = self._closing or "unloaded"
        with self._lock:
            jobs, embeds = self.policy.drain()
        for job in jobs:
            assert isinstance(job, GenJob)
            job.stream.cancel(f"unloaded: {reason}")
            try:
                self.out.finish(job, "cancelled")
            except Exception as e:  # noqa: BLE001 - the stream must end even if building its result fails
                job.stream._finish(None, ModelUnloaded(f"{self.name} stopped: {reason} ({e})"))
        for ej in embeds:
            ej.end(ModelUnloaded(f"{self.name} was unloaded ({reason}) before the embedding finished."))
        try:
            self.backend.close()
        finally:
            self.closed.set()
