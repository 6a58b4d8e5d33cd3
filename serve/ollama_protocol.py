"""Ollama's API as `a3b serve` reads and writes it: request fields into the runtime's types, and the
answer objects (NDJSON lines of /api/chat and /api/generate, their timing fields, errors). Plain
functions, no I/O: serving is ollama_api.py's job.

Every option is checked against its declaration in runtime/options/. Options that change the
answer are honoured (temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed,
num_predict, num_ctx, stop) or taken only at the value that leaves the answer as it is (mirostat 0,
tfs_z 1, typical_p 1, presence and frequency penalty 0); any other value, and any option this list
does not know, is a 400 naming it. Placement options (num_gpu, num_thread, use_mmap, ...) do not
change the answer: the served model keeps the placement it was loaded with.
"""
from __future__ import annotations

import datetime as _dt
import json
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..runtime import options as opt
from ..runtime.errors import InvalidRequest
from ..runtime.generation import GenerationResult, SamplingParams
from ..runtime.options import check
from ..runtime.requests import ImagePart
from .protocol.chat import message_list
from .protocol.fields import int_field, stops_of

#: The Ollama API version this server follows (GET /api/version): what its clients check features by.
API_VERSION = "0.9.0"
#: Ollama's own default tag: "name" and "name:latest" are the same model.
LATEST = ":latest"


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v == x and type(v) is not bool for x in values)


#: Options honoured, by Ollama's name: the runtime Option that checks it.
HONOURED: dict[str, opt.Option] = {
    "temperature": opt.TEMPERATURE, "top_k": opt.TOP_K, "top_p": opt.TOP_P, "min_p": opt.MIN_P,
    "repeat_penalty": opt.REPEAT_PENALTY, "repeat_last_n": opt.REPEAT_LAST_N, "seed": opt.SEED,
    "num_predict": opt.NUM_PREDICT, "num_ctx": opt.NUM_CTX,
}
#: ... and the stop strings (protocol.fields.stops_of checks them)
STOP = "stop"
#: Options that change the answer and are not honoured: taken only at their neutral value.
NEUTRAL_ONLY: dict[str, Callable[[Any], bool]] = {
    "mirostat": _is(0), "tfs_z": _is(1), "typical_p": _is(1), "presence_penalty": _is(0),
    "frequency_penalty": _is(0),
}
#: Options that never change the answer here: mirostat's settings (mirostat is off), the prompt
#: tokens kept when a context is cut (this server refuses instead of cutting), the newline penalty
#: (gone from llama.cpp's samplers), and where and how the model runs (fixed when it loads).
NO_EFFECT = frozenset({"mirostat_tau", "mirostat_eta", "num_keep", "penalize_newline", "numa", "num_batch",
                       "num_gpu", "main_gpu", "low_vram", "use_mmap", "use_mlock", "num_thread", "f16_kv",
                       "vocab_only", "logits_all", "embedding_only"})


def error_body(message: str) -> dict:
    """Ollama's error object."""
    return {"error": message[:2000]}


def bare(name: str) -> str:
    """A model name without Ollama's default tag."""
    return name[: -len(LATEST)] if name.endswith(LATEST) else name


def tagged(name: str) -> str:
    """A model id as Ollama lists it: with a tag (":latest" unless it has one)."""
    return name if ":" in name else name + LATEST


def model_of(body: dict, required: bool = True) -> str:
    """The request's model name ("model", or the older "name")."""
    name = body.get("model", body.get("name"))
    if name is None and not required:
        return ""
    if not isinstance(name, str) or not name:
        raise InvalidRequest("model is required: the name of a served model (GET /api/tags lists them).")
    return name


# -- durations ---------------------------------------------------------------------------------------
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(-?)((?:\d+(?:\.\d*)?(?:ns|us|µs|ms|s|m|h))+)")
_PART = re.compile(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)")


def keep_alive_of(body: dict) -> float | None:
    """keep_alive in seconds (a number of seconds, or a Go duration such as "5m" or "1h30m"; negative
    = keep loaded), or None when the request gives none."""
    v = body.get("keep_alive")
    if v is None:
        return None
    seconds: Any = v
    if isinstance(v, str):
        text = v.strip()
        if re.fullmatch(r"-?\d+(?:\.\d*)?", text):
            seconds = float(text)
        else:
            m = _DURATION.fullmatch(text) if len(text) <= 64 else None
            if m is None:
                raise InvalidRequest(f"keep_alive must be a number of seconds or a duration such as 5m, 1h or "
                                     f"30s (negative = keep loaded); got {v[:60]!r}")
            seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(m.group(2))) * (-1 if m.group(1) else 1)
    return check(opt.KEEP_ALIVE, seconds)


# -- options -----------------------------------------------------------------------------------------
def options_of(body: dict, n_ctx: int, model: str) -> dict:
    """The runtime's settings of a request's `options`: sampling, max_tokens, stop and num_ctx.
    InvalidRequest naming any option that is unknown, not honoured at its value, or out of bounds."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("options must be an object of option names and values.")
    unknown = [k for k in options if k not in HONOURED and k != STOP and k not in NEUTRAL_ONLY and k not in NO_EFFECT]
    if unknown:
        raise InvalidRequest(f"Unknown option(s): {', '.join(sorted(unknown)[:10])}. Taken: "
                             f"{', '.join(HONOURED)}, stop; {', '.join(NEUTRAL_ONLY)} at their neutral values.")
    for name, neutral in NEUTRAL_ONLY.items():
        v = options.get(name)
        if v is not None and not neutral(v):
            raise InvalidRequest(f"options.{name}={str(v)[:40]} is not supported by this server (its samplers do "
                                 "not include it); leave it out or send its neutral value.")
    fields: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
        if options.get(name) is not None:
            fields[name] = check(HONOURED[name], options[name], f"options.{name}")
    for name in ("top_k", "repeat_last_n"):
        if options.get(name) is not None:
            fields[name] = int_field(options, name, HONOURED[name])
    if options.get("seed") is not None:
        seed = int_field(options, "seed", replace(opt.SEED, min=-(2**63), max=2**64 - 1))
        fields["seed"] = opt.wrap_seed(seed) if seed >= 0 else None   # Ollama: negative = a fresh seed
    sampling = SamplingParams(**{**SamplingParams().__dict__, **fields})
    sampling.validate()
    ctx = n_ctx
    if options.get("num_ctx") is not None:
        ctx = int_field(options, "num_ctx", opt.NUM_CTX)
        if ctx > n_ctx:
            raise InvalidRequest(f"options.num_ctx={ctx} is beyond the context {model} is served with ({n_ctx} "
                                 "tokens, fixed when it loads: a3b serve --n-ctx); give num_ctx <= "
                                 f"{n_ctx} or leave it out.")
    max_tokens = ctx   # not clamped to the context: the answer ends at its end, and says so (context_full)
    if options.get("num_predict") is not None:
        n = int_field(options, "num_predict", opt.NUM_PREDICT)
        max_tokens = ctx if n < 0 else n
    return {"sampling": sampling, "max_tokens": max_tokens, "stop": stops_of({"stop": options.get("stop")}),
            "num_ctx": ctx if ctx < n_ctx else None}


def format_of(body: dict) -> dict | None:
    """`format` as the JSON schema the answer must follow: "json" is any JSON object, an object is a
    schema; "" or absent: free text."""
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "object"}
    if isinstance(fmt, dict):
        return check(opt.JSON_SCHEMA, fmt, "format")
    raise InvalidRequest(f'format must be "json" or a JSON schema object; got {str(fmt)[:60]!r}')


def think_of(body: dict) -> tuple[dict, dict]:
    """(the runtime's thinking settings, template variables) of `think`: true/false, or an effort."""
    think = body.get("think")
    if think is None:
        return {}, {}
    if isinstance(think, bool):
        return {"thinking": "on" if think else "off"}, {}
    if think in ("low", "medium", "high"):
        return {"thinking": "on"}, {"reasoning_effort": think}
    raise InvalidRequest(f'think must be true, false, "low", "medium" or "high"; got {str(think)[:40]!r}')


# -- messages and images -----------------------------------------------------------------------------
def images_of(images: Any, where: str) -> tuple[ImagePart, ...]:
    """Ollama's images: a list of base64 strings (a data URL is taken too)."""
    from ..runtime.images import from_data_url

    if images is None:
        return ()
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise InvalidRequest(f"{where} must be a list of base64-encoded images.")
    return tuple(from_data_url(i if i.startswith("data:") else "data:;base64," + i, f"{where}[{k}]")
                 for k, i in enumerate(images))


def messages_of(body: dict) -> list[dict]:
    """The chat's messages as the runtime takes them: images before the text of their message, the
    assistant's tool calls with their arguments, a tool's answer with its tool's name."""
    out = []
    for i, m in enumerate(message_list(body)):
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string (images go in messages[{i}].images).")
        images = images_of(m.get("images"), f"messages[{i}].images")
        msg: dict[str, Any] = {"role": m["role"], "content": (*images, content) if images else content}
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise InvalidRequest(f"messages[{i}].tool_calls must be a list of {{\"function\": {{\"name\", "
                                     "\"arguments\"}} objects.")
            msg["tool_calls"] = [{"type": "function", "function": c["function"]} for c in calls]
        name = m.get("tool_name", m.get("name"))
        if isinstance(name, str):
            msg["name"] = name
        if m.get("thinking") and m["role"] == "assistant" and isinstance(m["thinking"], str):
            msg["reasoning_content"] = m["thinking"]
        out.append(msg)
    return out


def tools_of(body: dict) -> tuple[dict, ...]:
    tools = body.get("tools")
    if tools is None or tools == []:
        return ()
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest('tools must be a list of {"type": "function", "function": {...}} objects.')
    return tuple(tools)


def ollama_call(call: dict) -> dict:
    """An OpenAI-shaped tool call (tools.py) as Ollama sends it: arguments as an object."""
    f = call["function"]
    try:
        args = json.loads(f["arguments"]) if isinstance(f["arguments"], str) else f["arguments"]
    except json.JSONDecodeError:
        args = {}
    return {"function": {"name": f["name"], "arguments": args}}


# -- answers -----------------------------------------------------------------------------------------
def now() -> str:
    """Ollama's created_at: UTC, RFC 3339 with fractions."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z")


def line(obj: dict) -> bytes:
    """One NDJSON line."""
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def done_reason(res: GenerationResult) -> str:
    return {"cancelled": "stop", "error": "stop"}.get(res.finish_reason, res.finish_reason)


def a3b_block(res: GenerationResult, route: dict) -> dict:
    """The a3b block of a done object: where a routed request went, and whether the context's end cut
    the answer (done_reason "length" then, as at num_predict)."""
    block = {**route, **({"context_full": True} if res.context_full else {})}
    return {"a3b": block} if block else {}


def timings(res: GenerationResult | None, total_s: float, load_s: float) -> dict:
    """The counts and durations (nanoseconds) Ollama reports at the end of an answer."""
    ns = 1_000_000_000
    out = {"total_duration": int(total_s * ns), "load_duration": int(load_s * ns)}
    if res is not None:
        out.update(prompt_eval_count=res.n_prompt_tokens, prompt_eval_duration=int(res.time_to_first_token * ns),
                   eval_count=res.n_tokens, eval_duration=int(res.decode_time * ns))
    return out


__all__ = ["API_VERSION", "HONOURED", "NEUTRAL_ONLY", "NO_EFFECT", "bare", "done_reason", "error_body",
           "format_of", "images_of", "keep_alive_of", "line", "messages_of", "model_of", "now", "ollama_call",
           "options_of", "tagged", "think_of", "timings", "tools_of"]
