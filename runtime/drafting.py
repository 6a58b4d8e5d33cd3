"""Which drafter a request gets, and filling a decode step's drafts (speculative decoding).

The worker asks `for_request` once per request: the request's `speculative` setting (else the
model's LoadSpec) picks n-gram lookup, the model's draft model (loaded with the model, see
`LoadedModel.draft_source`), or nothing. `fill` runs on the worker thread between planning a step
and decoding it: every entry the policy granted room gets that many drafted tokens at most.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import InvalidRequest
from .scheduler import DecodeStep
from .speculative import NgramDrafter, SpecControl, parse_mode

if TYPE_CHECKING:  # pragma: no cover
    from .requests import GenerationRequest


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
    step.number_rows()
