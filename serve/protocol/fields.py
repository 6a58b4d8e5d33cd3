"""The request fields `a3b serve`'s OpenAI and llama-server endpoints read, each declared once: its
name on the wire, the names it also comes under, and the runtime Option (runtime/options/) that
gives its bounds and help. The readers below check a field against that declaration; a field that
does not fit is a 400 naming it, never a value quietly dropped or clamped.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...runtime import options as opt
from ...runtime.errors import InvalidRequest
from ...runtime.generation import MAX_STOP_STRINGS, ConfidenceConfig, SamplingParams, check_stops
from ...runtime.options import Option, check, wrap_seed


@dataclass(frozen=True)
class Field:
    """One request field: its wire name, the names it also comes under, and the runtime's Option
    that declares its bounds and help (None for a field of the wire alone, whose help is `about`)."""

    name: str
    option: Option | None = None
    aliases: tuple[str, ...] = ()
    about: str = ""

    @property
    def help(self) -> str:
        return self.option.help if self.option is not None else self.about

    def raw(self, body: dict) -> Any:
        """The value sent under the name (null included), else under the first alias sent; None when absent."""
        if self.name in body:
            return body[self.name]
        return next((body[a] for a in self.aliases if a in body), None)

    def integer(self, body: dict, default: int | None = None) -> int | None:
        """The field as its Option takes an integer (a float with an integer value counts)."""
        assert self.option is not None
        return int_field(body, self.name, self.option, default)


def _declare(*fields: Field) -> dict[str, Field]:
    return {f.name: f for f in fields}


#: Every field these endpoints read, by wire name.
FIELDS: dict[str, Field] = _declare(
    Field("model", about="The served model's id (GET /v1/models), or the route table's name."),
    Field("stream", about="Answer as server-sent events."),
    Field("stream_options", about="OpenAI's {include_usage}: a last event with the usage."),
    Field("n", about="Choices per request: 1 only."),
    Field("max_tokens", opt.MAX_TOKENS),
    Field("max_completion_tokens", opt.MAX_TOKENS),
    Field("n_predict", opt.N_PREDICT),
    Field("temperature", opt.TEMPERATURE),
    Field("top_p", opt.TOP_P),
    Field("top_k", opt.TOP_K),
    Field("min_p", opt.MIN_P),
    Field("repeat_penalty", opt.REPEAT_PENALTY, ("repetition_penalty",)),
    Field("repeat_last_n", opt.REPEAT_LAST_N),
    Field("ignore_eos", opt.IGNORE_EOS),
    Field("samplers", opt.SAMPLERS),
    Field("seed", opt.SEED),
    Field("stop", about=f"A stop string, or a list of at most {MAX_STOP_STRINGS}."),
    Field("logprobs", opt.LOGPROBS),
    Field("top_logprobs", opt.LOGPROBS),
    Field("n_probs", opt.LOGPROBS),
    Field("confidence", about="a3b's low-confidence spans: true, or an object with "
                              f"{' and '.join(opt.CONFIDENCE_OPTIONS)}."),
    Field("speculative", opt.SPECULATIVE),
    Field("draft_max", opt.DRAFT_MAX),
    Field("n_indent", opt.N_INDENT),
    Field("reasoning_budget", opt.REASONING_BUDGET),
    Field("max_total_tokens", opt.MAX_TOTAL_TOKENS),
    Field("reasoning_effort", about="OpenAI's effort: none switches thinking off, the others on."),
    Field("think", about="Ollama's switch: true, false or an effort."),
    Field("chat_template_kwargs", about="Variables for the chat template."),
    Field("json_schema", opt.JSON_SCHEMA),
    Field("response_format", about="OpenAI's text, json_object or json_schema."),
    Field("grammar", about="A GBNF grammar the answer follows."),
    Field("tools", about="OpenAI's function tools."),
    Field("tool_choice", about="auto or none."),
    Field("messages", about="The chat: {role, content} objects; content text or content parts."),
    Field("prompt", about="The text (or one list of token ids) to continue."),
    Field("input_prefix", about="/infill: the text before the cursor."),
    Field("input_suffix", about="/infill: the text after the cursor."),
    Field("input_extra", about="/infill: context chunks, {filename, text} objects."),
    Field("t_max_predict_ms", opt.T_MAX_PREDICT_MS),
    Field("input", about="/v1/embeddings: a string or a list of strings."),
    Field("encoding_format", about="/v1/embeddings: float or base64."),
    Field("content", about="/tokenize: the text."),
    Field("add_special", about="/tokenize: add the BOS and read special tokens."),
)
F = FIELDS


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v == x and type(v) is not bool or v is x for x in values)


#: Fields of OpenAI's and llama-server's APIs that change the answer and that this server does not
#: honour, each with the values that leave the answer as it is: any other value is a 400 naming the
#: field, never a field quietly dropped (a field absent or null is left alone).
NOT_HONOURED: dict[str, Callable[[Any], bool]] = {
    "frequency_penalty": _is(0), "presence_penalty": _is(0), "logit_bias": _is({}), "best_of": _is(1),
    "echo": _is(False), "suffix": _is(""), "typical_p": _is(1), "tfs_z": _is(1), "mirostat": _is(0),
    "dynatemp_range": _is(0), "xtc_probability": _is(0), "dry_multiplier": _is(0), "top_n_sigma": _is(-1),
    "penalize_nl": _is(False), "lora": _is([]),
    "image_data": _is([]), "audio": lambda v: False, "min_keep": _is(0, 1),
    "logits_processors": lambda v: False, "guided_regex": lambda v: False, "guided_choice": lambda v: False,
}


def refuse_not_honoured(body: dict) -> None:
    """InvalidRequest naming a field that would change the answer and that this server ignores."""
    for name, neutral in NOT_HONOURED.items():
        v = body.get(name)
        if v is not None and not neutral(v):
            text = repr(v)
            raise InvalidRequest(f"{name}={text[:60]}{'...' if len(text) > 60 else ''} is not supported by this "
                                 f"server; leave it out (or send its neutral value).")


def int_field(body: dict, name: str, option: Option, default: int | None = None) -> int | None:
    """body[name] as `option` takes it (a float with an integer value counts), or `default` when absent."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return check(option, v, name)


def sampling_of(body: dict) -> SamplingParams:
    """SamplingParams from an OpenAI (or llama-server) body; fields left out keep the runtime's defaults."""
    d = SamplingParams()
    fields: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
        v = F[name].raw(body)
        if v is not None:
            fields[name] = v
    for name in ("top_k", "repeat_last_n"):
        if body.get(name) is not None:
            fields[name] = F[name].integer(body)
    for name in ("ignore_eos", "samplers"):
        if body.get(name) is not None:
            fields[name] = check(F[name].option, body[name])
    if body.get("seed") is not None:
        fields["seed"] = wrap_seed(body["seed"])
    sp = SamplingParams(**{**d.__dict__, **fields})
    sp.validate()
    return sp


def stops_of(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings.")
    return check_stops(s for s in stop if s)


def logprobs_of(body: dict, chat: bool) -> int | None:
    """OpenAI's logprobs (chat: logprobs + top_logprobs); llama-server's n_probs for text and /infill."""
    if chat:
        if body.get("n_probs"):
            raise InvalidRequest("n_probs is llama-server's field for text completions and /infill; a chat asks "
                                 "with logprobs and top_logprobs.")
        if not body.get("logprobs"):
            return None
        return F["top_logprobs"].integer(body, 0)
    if body.get("logprobs") is None or body.get("logprobs") is False:
        return F["n_probs"].integer(body) or None
    return F["logprobs"].integer(body, 0)


def speculative_of(body: dict) -> tuple[str | None, int | None]:
    """The request's speculative decoding fields (runtime/options: speculative, draft_max): (mode, draft_max)."""
    value = body.get(opt.SPECULATIVE.name)
    if value is not None:
        check(opt.SPECULATIVE, value)   # its form too: draft needs a model
    return value, F["draft_max"].integer(body)


def confidence_of(body: dict) -> ConfidenceConfig:
    """The request's confidence spans (a3b's field `confidence`): off unless asked, since OpenAI's
    clients do not read them and they cost every token an entropy on the CPU (and the CPU sampler).
    True, or an object with `threshold` and `min_run` (runtime/options/), turns them on."""
    value = body.get("confidence")
    if value is None or value is False:
        return ConfidenceConfig(enabled=False)
    if value is True:
        return ConfidenceConfig(enabled=True)
    if not isinstance(value, dict) or set(value) - set(opt.CONFIDENCE_OPTIONS):
        raise InvalidRequest("confidence must be true, false or an object with threshold and min_run.")
    conf = ConfidenceConfig(enabled=True, **{k: v for k, v in value.items() if v is not None})
    conf.validate()
    return conf


__all__ = ["F", "FIELDS", "Field", "NOT_HONOURED", "confidence_of", "int_field", "logprobs_of",
           "refuse_not_honoured", "sampling_of", "speculative_of", "stops_of"]
