"""A draft model for speculative decoding: a smaller model with the same vocabulary proposes tokens
(or, under speculative=mtp, the model's own multi-token-prediction layers: `MtpSource`).

The draft model is an ordinary entry of the model store (store.py): a LoadSpec of the draft file
with the target's slots, a context a little longer than the target's (a sequence and its drafts
fit) and no speculation of its own. So its weights are one copy shared with whoever else uses the
file (the target itself when a model drafts for itself), and its worker thread, scheduler and KV
prefix reuse are the ordinary ones: every draft is a short greedy request whose prompt is the
target sequence so far, and the slot that holds the previous draft's sequence is found by its
common prefix, so only the tokens accepted since (and the target's own next token) are read.

The target's worker submits the drafts of all its decoding requests before waiting for any, so the
draft model drafts for all of them in the same batched steps. Each wait is bounded: a draft that
is late, or a draft model that went away, yields no draft (the step decodes without one).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..errors import A3BError, InvalidRequest
from ..generation import ConfidenceConfig, SamplingParams
from ..options import LoadSpec, parse_speculative
from ..requests import GenerationRequest, TokenPrompt
from .speculative import Drafter

log = logging.getLogger("a3b.draft")

#: the longest a target step waits for its drafts (seconds)
DRAFT_TIMEOUT_S = 10.0
GREEDY = SamplingParams(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
NO_CONFIDENCE = ConfidenceConfig(enabled=False)
#: texts whose tokens must be the same in both vocabularies (besides their sizes and special tokens)
PROBES = ("def main():\n    return 0\n", "The quick brown fox, 1234 émigrés.")


def draft_spec(spec: LoadSpec) -> LoadSpec | None:
    """The draft model's LoadSpec for target `spec`, or None when `spec` drafts with none."""
    mode, path = parse_speculative(spec.speculative)
    if mode != "draft":
        return None
    return LoadSpec(path=path, n_ctx=spec.n_ctx + spec.draft_max + 1, n_parallel=spec.n_parallel,
                    n_gpu_layers=spec.n_gpu_layers, n_threads=spec.n_threads, n_batch=max(spec.n_batch, 64),
                    flash_attn=spec.flash_attn, use_mmap=spec.use_mmap, speculative="off",
                    ctx_policy="warn")


def check_vocab(target: Any, draft: Any) -> None:
    """InvalidRequest naming both models unless `draft` tokenizes as `target` does."""
    tv, dv = target.vocab, draft.vocab
    why = None
    if tv.n_vocab != dv.n_vocab:
        why = f"{tv.n_vocab} and {dv.n_vocab} tokens"
    elif (tv.bos, tv.eos) != (dv.bos, dv.eos):
        why = f"different special tokens (bos/eos {tv.bos}/{tv.eos} and {dv.bos}/{dv.eos})"
    else:
        for text in PROBES:
            if tv.tokenize(text, add_bos=False, special=False) != dv.tokenize(text, add_bos=False, special=False):
                why = f"different tokens for {text!r}"
                break
    if why:
        raise InvalidRequest(f"The draft model {draft.name} does not share the vocabulary of {target.name} "
                             f"({why}); a draft model must use the same tokenizer. Choose another, or "
                             "speculative=ngram.")


def attach_mtp(model: Any) -> None:
    """speculative=mtp: give `model` its own multi-token-prediction layers as its drafter, or a message
    naming what the file lacks."""
    n = model.weights.n_layer_nextn
    if n <= 0:
        raise InvalidRequest(f"{model.name} ({model.info.architecture}) has no multi-token-prediction layers, so "
                             "speculative=mtp cannot draft with them; use speculative=ngram or draft:MODEL.")
    mtp = model.backend.mtp
    if mtp is None:
        raise InvalidRequest(f"{model.name} has {n} multi-token-prediction layer(s), but this engine cannot draft "
                             "with them; use speculative=ngram or draft:MODEL.")
    model.draft_source = MtpSource(mtp)


class MtpSource:
    """What a model drafts with under speculative=mtp: its own MTP context (llama/mtp.py), which
    drafts for every request of a step in one batch per drafted position."""

    mode = "mtp"
    model = None

    def __init__(self, context: Any):
        self.context = context

    def new_drafter(self) -> MtpDrafter:
        return MtpDrafter(self.context)


class MtpDrafter(Drafter):
    """One request's drafts from the MTP context, in the two phases of `ModelDrafter`; `place` tells
    it where the request's next token sits (its sequence and position)."""

    def __init__(self, context: Any):
        self.context = context
        self.seq: Sequence[int] = ()
        self._at: tuple[int, int] | None = None
        self._asked = False
        self.failures = 0

    def extend(self, seq: Sequence[int]) -> None:
        self.seq = seq

    def place(self, seq_id: int, position: int) -> None:
        self._at = (seq_id, position)

    def begin(self, k: int, priority: int = 0) -> None:
        self._asked = bool(k > 0 and self._at is not None and self.seq and self.failures < 3)
        if self._asked:
            self.context.want(self._at[0], self.seq[-1], self._at[1], k)

    def end(self) -> list[int]:
        if not self._asked:
            return []
        self._asked = False
        try:
            return self.context.take(self._at[0])
        except RuntimeError as e:   # a failed MTP step: no draft now, none after the third
            self.failures += 1
            log.warning("multi-token prediction: %s%s", e, "; drafting stops for this request"
                        if self.failures >= 3 else "")
            return []


def attach(model: Any, models: Callable[[LoadSpec], Any]) -> None:
    """As `model` opens: attach what its LoadSpec's `speculative` setting drafts with, a draft model
    got through `models` (the model store: the draft is an entry of its own there) or its own MTP
    layers; InvalidRequest when it cannot draft so. Nothing for the other settings."""
    dspec = draft_spec(model.spec)
    if dspec is not None:
        attach_draft(model, dspec, lambda: models(dspec))
    elif parse_speculative(model.spec.speculative)[0] == "mtp":
        attach_mtp(model)


def attach_draft(model: Any, dspec: LoadSpec, get: Callable[[], Any]) -> None:
    """Give target `model` its draft model (loaded now through `get`, checked for its vocabulary)."""
    draft = get()
    if not draft.runs_here:
        raise InvalidRequest(f"The draft model {draft.name} runs in another engine; a draft model must run here.")
    check_vocab(model, draft)
    model.draft_source = DraftSource(dspec.path, lambda: get() if model.alive else None)


class DraftSource:
    """What a target model drafts with: the draft model of its LoadSpec, reached through the store."""

    mode = "draft"

    def __init__(self, model: str, get: Callable[[], Any]):
        self.model = model      # the draft file, as the target's speculative setting names it
        #: the draft Model from the store (loads it again after an eviction); None once the target
        #: is closing, so that an unload does not load the draft model again
        self._get = get

    def new_drafter(self) -> ModelDrafter:
        return ModelDrafter(self)

    def model_now(self) -> Any:
        return self._get()


class ModelDrafter(Drafter):
    """One request's drafts from the draft model, in two phases (`begin` for every request of a
    step, then `end` for each) so that the draft model batches them."""

    def __init__(self, source: DraftSource):
        self.source = source
        self.seq: Sequence[int] = ()
        self._stream: Any = None
        self.failures = 0

    def extend(self, seq: Sequence[int]) -> None:
        self.seq = seq

    def begin(self, k: int, priority: int = 0) -> None:
        self._stream = None
        if k <= 0 or self.failures >= 3:
            return
        try:
            req = GenerationRequest(TokenPrompt(tuple(self.seq)), max_tokens=k, sampling=replace(GREEDY, seed=0),
                                    confidence=NO_CONFIDENCE, priority=priority, speculative="off")
            draft = self.source.model_now()
            self._stream = draft.submit(req) if draft is not None else None
        except A3BError as e:
            self._fail(e)

    def end(self) -> list[int]:
        stream, self._stream = self._stream, None
        if stream is None:
            return []
        try:
            res = stream.result(timeout=DRAFT_TIMEOUT_S)
        except TimeoutError:
            stream.cancel("draft too late")
            return []
        except A3BError as e:
            self._fail(e)
            return []
        return list(res.tokens or [])

    def propose(self, k: int) -> list[int]:
        self.begin(k)
        return self.end()

    def _fail(self, e: BaseException) -> None:
        self.failures += 1
        log.warning("draft model %s: %s%s", self.source.model, e,
                    "; drafting stops for this request" if self.failures >= 3 else "")
