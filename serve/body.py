"""How `a3b serve` reads a request: the JSON body, bounded in size, and the fields the endpoints
share, each checked against its declaration in runtime/options.py (a field that does not fit is a
400 naming it, never a value quietly dropped or clamped).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.requests import Request

from ..runtime import options as opt
from ..runtime.errors import InvalidRequest
from ..runtime.images import from_data_url
from ..runtime.generation import MAX_STOP_STRINGS, SamplingParams, check_stops
from ..runtime.options import Option, check, wrap_seed

#: Largest request body read (a chat with a long context is well below it).
MAX_BODY = 16 << 20


async def read_json(request: Request) -> dict:
    size = int(request.headers.get("content-length") or 0)
    if size > MAX_BODY:
        raise InvalidRequest(f"The request body is {size} bytes; at most {MAX_BODY} are read.")
    chunks, n = [], 0   # joined once: growing one bytes object copies it at every chunk
    async for chunk in request.stream():
        chunks.append(chunk)
        n += len(chunk)
        if n > MAX_BODY:
            raise InvalidRequest(f"The request body is larger than {MAX_BODY} bytes.")
    raw = b"".join(chunks)
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"The request body is not JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("The request body is nested too deeply to read.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


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
    for name, alias in (("temperature", None), ("top_p", None), ("min_p", None),
                        ("repeat_penalty", "repetition_penalty")):
        v = body.get(name, body.get(alias) if alias else None)
        if v is not None:
            fields[name] = v
    if body.get("top_k") is not None:
        fields["top_k"] = int_field(body, "top_k", opt.TOP_K)
    if body.get("repeat_last_n") is not None:
        fields["repeat_last_n"] = int_field(body, "repeat_last_n", opt.REPEAT_LAST_N)
    if body.get("ignore_eos") is not None:
        fields["ignore_eos"] = check(opt.IGNORE_EOS, body["ignore_eos"])
    if body.get("samplers") is not None:
        fields["samplers"] = check(opt.SAMPLERS, body["samplers"])
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


def messages_of(body: dict) -> list[dict]:
    """The chat messages of a request: text content, or OpenAI's content parts (text, and images as
    `image_url` data URLs: the server fetches nothing)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects.")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string role.")
        content = m.get("content")
        if isinstance(content, list):
            content = content_parts_of(content, f"messages[{i}]")
        if content is None:
            content = ""
        if not isinstance(content, (str, tuple)):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of content parts.")
        out.append({"role": m["role"], "content": content})
    return out


def content_parts_of(parts: list, where: str) -> str | tuple:
    """Content parts as the runtime's: text alone stays one string; with images, a tuple of text and
    ImageParts in their order."""
    out: list = []
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            if out and isinstance(out[-1], str):
                out[-1] += p["text"]
            else:
                out.append(p["text"])
        elif kind == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            out.append(from_data_url(url, f"{where}.content[{j}]"))
        else:
            raise InvalidRequest(f"{where}.content[{j}]: only text and image_url content parts are supported, got "
                                 f"{str(kind or p)[:40]!r}.")
    if all(isinstance(x, str) for x in out):
        return "".join(out)
    return tuple(out)


def logprobs_of(body: dict, chat: bool) -> int | None:
    """OpenAI's logprobs (chat: logprobs + top_logprobs); llama-server's n_probs for text and /infill."""
    if chat:
        if body.get("n_probs"):
            raise InvalidRequest("n_probs is llama-server's field for text completions and /infill; a chat asks "
                                 "with logprobs and top_logprobs.")
        if not body.get("logprobs"):
            return None
        return int_field(body, "top_logprobs", opt.LOGPROBS, 0)
    if body.get("logprobs") is None or body.get("logprobs") is False:
        return int_field(body, "n_probs", opt.LOGPROBS) or None
    return int_field(body, "logprobs", opt.LOGPROBS, 0)


def speculative_of(body: dict) -> dict:
    """The request's speculative decoding fields (options.py: speculative, draft_max), where given."""
    out: dict = {}
    value = body.get(opt.SPECULATIVE.name)
    if value is not None:
        check(opt.SPECULATIVE, value)
        opt.parse_speculative(value)
        out["speculative"] = value
    if body.get(opt.DRAFT_MAX.name) is not None:
        out["draft_max"] = int_field(body, opt.DRAFT_MAX.name, opt.DRAFT_MAX)
    return out


def confidence_of(body: dict):
    """The request's confidence spans (a3b's field `confidence`): off unless asked, since OpenAI's
    clients do not read them and they cost every token an entropy on the CPU (and the CPU sampler).
    True, or an object with `threshold` and `min_run` (options.py), turns them on."""
    from ..runtime.generation import ConfidenceConfig

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
