"""What every generating endpoint's request shares (model, length, sampling, stops, log-probabilities,
confidence spans, speculative decoding, streaming), read once from the JSON body into `Generation`;
and the structured-output fields that the chat and text completions share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...runtime import options as opt
from ...runtime.errors import InvalidRequest
from ...runtime.generation import ConfidenceConfig, SamplingParams
from ...runtime.options import check
from .fields import F, confidence_of, logprobs_of, refuse_not_honoured, sampling_of, speculative_of, stops_of

#: Most characters of a request handed to a router (it reads only the head anyway).
MAX_ROUTED_CHARS = 1 << 16


@dataclass(frozen=True)
class Generation:
    """The settings of one generation, as the runtime takes them (Runtime.submit's keywords)."""

    #: the model named (None or "": the served one, or the route table's when there is one)
    model: Any
    #: the answer's length: max_completion_tokens, max_tokens or n_predict (not clamped to the
    #: context: an answer runs until it or the context's end, which the result then reports)
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    logprobs: int | None
    confidence: ConfidenceConfig
    speculative: str | None
    draft_max: int | None
    n_indent: int | None
    stream: bool
    include_usage: bool
    #: the text a router picks the model by: the last user message's text, or the prompt
    route_text: str

    def settings(self) -> dict:
        """Runtime.submit's keywords (a field not sent keeps the runtime's default)."""
        out = dict(max_tokens=self.max_tokens, sampling=self.sampling, stop=self.stop, logprobs=self.logprobs,
                   confidence=self.confidence)
        for name in ("speculative", "draft_max", "n_indent"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def generation_of(body: dict, chat: bool, default_n_predict: int | None = None) -> Generation:
    """The shared settings of a body; `default_n_predict` stands for n_predict when neither it nor
    max_tokens is sent (/infill's shorter default)."""
    refuse_not_honoured(body)
    n = body.get("n", 1)
    if n != 1:
        raise InvalidRequest("n must be 1: one choice per request.")
    max_tokens = F["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"].integer(body)
    n_predict = body.get("n_predict")
    if n_predict is None and body.get("max_tokens") is None and default_n_predict is not None:
        body = {**body, "n_predict": default_n_predict}
    if body.get("n_predict") is not None and max_tokens is None:
        max_tokens = F["n_predict"].integer(body)
        max_tokens = None if max_tokens in (-1, 0) else max_tokens
    speculative, draft_max = speculative_of(body)
    n_indent = F["n_indent"].integer(body)
    stream_options = body.get("stream_options")
    return Generation(
        model=body.get("model"), max_tokens=max_tokens or opt.MAX_TOKENS.default, sampling=sampling_of(body),
        stop=stops_of(body), logprobs=logprobs_of(body, chat), confidence=confidence_of(body),
        speculative=speculative, draft_max=draft_max, n_indent=n_indent, stream=bool(body.get("stream")),
        include_usage=bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
        route_text=route_text(body))


def route_text(body: dict) -> str:
    """The text a request is routed by: its last user message (the text parts of its content), or
    its prompt."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        for m in reversed(msgs):
            if isinstance(m, dict) and m.get("role") == "user":
                c = m.get("content")
                if isinstance(c, list):
                    c = " ".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
                return c[:MAX_ROUTED_CHARS] if isinstance(c, str) else ""
        return ""
    p = body.get("prompt")
    return p[:MAX_ROUTED_CHARS] if isinstance(p, str) else ""


@dataclass(frozen=True)
class Structured:
    """The structured output asked for: a JSON schema or a GBNF grammar (llama-server's fields,
    OpenAI's response_format)."""

    json_schema: dict | None = None
    grammar: Any = None

    def settings(self) -> dict:
        return {**({"json_schema": self.json_schema} if self.json_schema is not None else {}),
                **({"grammar": self.grammar} if self.grammar is not None else {})}

    @property
    def given(self) -> bool:
        return self.json_schema is not None or self.grammar is not None


def structured_of(body: dict) -> Structured:
    return Structured(response_schema(body), body.get("grammar"))


def response_schema(body: dict) -> dict | None:
    """The JSON schema the answer must follow, from response_format or llama-server's json_schema."""
    rf = body.get("response_format")
    if body.get("json_schema") is not None:
        if rf is not None:
            raise InvalidRequest("Give response_format or json_schema, not both.")
        return check(opt.JSON_SCHEMA, body["json_schema"])
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest('response_format must be {"type": "text"}, {"type": "json_object"} or '
                             '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}.')
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return rf.get("schema") or {"type": "object"}
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        raise InvalidRequest('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}.')
    return js["schema"]


__all__ = ["Generation", "MAX_ROUTED_CHARS", "Structured", "generation_of", "response_schema", "route_text",
           "structured_of"]
