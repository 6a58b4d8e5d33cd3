"""Which drafter a request gets, and filling a decode step's drafts (speculative decoding).

The worker asks `for_request` once per request: the request's `speculative` setting (else the
model's LoadSpec) picks n-gram lookup, the model's draft model (loaded with the model, see
`LoadedModel.draft_source`), or nothing. `fill` runs on the worker thread between planning a step
and decoding it: every entry the policy granted room gets that many drafted tokens at most, then
`even` cuts the drafts where their uneven lengths would cost more passes than they bring.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import slots
from ..errors import InvalidRequest
from .scheduler import DecodeStep
from .steps import Entry
from .speculative import NgramDrafter, SpecControl, parse_mode

if TYPE_CHECKING:  # pragma: no cover
    from ..requests import GenerationRequest


def for_request(model: Any, request: GenerationRequest) -> tuple[Any, SpecControl | None]:
    """(drafter, K policy) for `request` on `model` (a LoadedModel), or (None, None): no speculation."""
    spec = model.spec
    mode, draft = parse_mode(request.speculative if request.speculative is not None else spec.speculative)
    k_max = request.draft_max if request.draft_max is not None else spec.draft_max
    if mode == "off":
        return None, None
    # a model with recurrent layers undoes a rejected draft only from the snapshots its context
    # keeps (as many as draft_max when it was loaded with speculation asked for by name; none
    # under "auto", where they would cost memory nobody asked for)
    rollback = model.backend.max_rollback
    if rollback is not None and rollback < 1:
        if mode == "auto":
            return None, None
        raise InvalidRequest(f"speculative={mode!r} on {model.name}: its recurrent layers can undo rejected drafts "
                             f"only when the model is loaded with speculative={mode!r} (it was loaded with "
                             f"{spec.speculative!r}); load it so, or ask speculative='off'.")
    if rollback is not None:
        k_max = min(k_max, rollback)
    source = model.draft_source
    if mode in ("draft", "mtp"):
        if source is None or source.mode != mode or (mode == "draft" and Path(draft).name != Path(source.model).name):
            loaded = spec.speculative
            raise InvalidRequest(f"speculative={request.speculative or spec.speculative!r} needs the model loaded "
                                 f"with it (it was loaded with speculative={loaded!r}); load it with "
                                 f"speculative={mode if mode == 'mtp' else 'draft:' + str(draft)!r}.")
        return source.new_drafter(), SpecControl(k_max, model.step_cost)
    if mode == "auto" and source is not None:   # the model was loaded with a drafter: use it
        return source.new_drafter(), SpecControl(k_max, model.step_cost)
    return NgramDrafter(), SpecControl(k_max, model.step_cost)


def fill(step: DecodeStep) -> None:
    """Draft for every entry of `step` that the policy granted room."""
    todo = [e for e in step.entries if e.room > 0 and e.job.drafter is not None]
    for e in todo:   # a draft model drafts for every request at once: all begin, then all end
        e.job.drafter.extend(e.job.seq)
        e.job.drafter.place(e.job.slot.seq_id, e.position)
        e.job.drafter.begin(e.room, e.job.priority)
    for e in todo:
        e.draft = list(e.job.drafter.end())[:e.room]
    even(step)
    step.number_rows()


def even(step: DecodeStep) -> None:
    """Drafts as proposed, or every decoding row's trimmed to the shortest among them: whichever gives
    more tokens per pass through the model.

    llama.cpp's equal split (slots.py) takes as many tokens of each sequence into a micro-batch, so
    where several rows decode, a row that drafts more than the others is computed in a pass of its
    own: one drafting row beside 15 that do not makes a step two passes, and each pass reads every
    weight again. On a GPU a step's shape that changes from step to step also replays no CUDA graph
    (ggml-cuda captures one after two calls of the same shape). Measured on one H200 at 16 streaming
    clients (random Qwen3-8B, greedy: n-gram drafts all accepted), four runs of each, alternating:
    1907-2043 tokens/s with this rule, 1462-1868 without it, where the cost model paused every
    request's drafts after uneven steps in two runs of four. A row
    yields its token and the drafts it is expected to have accepted (its request's acceptance rate per
    drafted position, speculative.SpecControl); a pass is counted as the same cost whatever its
    tokens, as on a GPU (the weights are read once a pass); the time a step takes is then learnt by
    the cost model from the steps that ran."""
    rows = [e for e in step.entries if e.unit is None]
    decoding = [e for e in rows if e.output is not None and e.count == 1]
    if len(decoding) < 2 or not any(e.draft for e in decoding):
        return
    shortest = min(len(e.draft) for e in decoding)
    # the tokens that count are those of the class the step serves: a batch job riding beside an
    # editor's request (scheduler.py) does not cut the editor's drafts for its own pass
    top = max(e.job.base_priority for e in rows)

    def per_pass(cap: int | None) -> float:
        kept = {id(e): len(e.draft) if cap is None else min(len(e.draft), cap) for e in rows}
        made = sum(1 + expected(e, kept[id(e)]) for e in rows if e.output is not None and e.job.base_priority == top)
        return made / slots.passes([(e.job.slot.seq_id, e.count + kept[id(e)]) for e in rows])

    if per_pass(shortest) >= per_pass(None):
        for e in decoding:
            del e.draft[shortest:]


def expected(entry: Entry, k: int) -> float:
    """Drafted tokens of `entry` expected to be accepted of its first `k` (each position accepted with
    its request's acceptance rate, given the ones before it were)."""
    control = entry.job.control
    rate = control.rate if control is not None else 0.5
    return sum(rate ** i for i in range(1, k + 1))
