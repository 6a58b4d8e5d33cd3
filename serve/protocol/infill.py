"""llama-server's `POST /infill`: fill in the middle, read once from its JSON body: the text before
and after the cursor (`input_prefix`, `input_suffix`), the `prompt` typed at the cursor, context
chunks (`input_extra`), a time limit (`t_max_predict_ms`) and the shared fields (common.py). With no
n_predict nor max_tokens, the answer's length is /infill's own default (options.INFILL_N_PREDICT).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...runtime import options as opt
from ...runtime.errors import InvalidRequest
from ...runtime.requests import ContextChunk, InfillPrompt
from .common import Generation, generation_of
from .fields import F


@dataclass(frozen=True)
class InfillRequest:
    prompt: InfillPrompt
    gen: Generation
    #: the generation's time limit in seconds; None: none
    deadline_s: float | None = None

    def settings(self) -> dict:
        return self.gen.settings()


def parse_infill(body: dict) -> InfillRequest:
    """The /infill request of a JSON body, or InvalidRequest naming the field that does not fit."""
    parts = {}
    for name in ("input_prefix", "input_suffix", "prompt"):
        v = body.get(name, "")
        if not isinstance(v, str):
            raise InvalidRequest(f"{name} must be a string.")
        parts[name] = v
    extra = body.get("input_extra") or []
    if not isinstance(extra, list) or not all(isinstance(c, dict) and isinstance(c.get("text", ""), str)
                                              and isinstance(c.get("filename", ""), str) for c in extra):
        raise InvalidRequest("input_extra must be a list of {filename, text} objects.")
    deadline_s = None
    if body.get("t_max_predict_ms") is not None:
        deadline_s = F["t_max_predict_ms"].integer(body) / 1000.0 or None
    prompt = InfillPrompt(parts["input_prefix"], parts["input_suffix"], parts["prompt"],
                          tuple(ContextChunk(c.get("filename", ""), c.get("text", "")) for c in extra))
    gen = generation_of(body, chat=False, default_n_predict=opt.INFILL_N_PREDICT.default)
    return InfillRequest(prompt, gen, deadline_s)


__all__ = ["InfillRequest", "parse_infill"]
