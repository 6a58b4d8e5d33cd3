"""The answer objects of `a3b serve`: OpenAI's chat and text completions (whole and as stream
chunks), their usage and the two logprobs formats, and llama-server's /infill answer with its tail
of counts and timings. Plain functions of a generation's result and token events: no I/O.
"""
from __future__ import annotations

import json
import time
from typing import Any

from ..runtime.generation import GenerationResult, TokenEvent
from .chatout import ChatOutput


def event(obj: dict) -> bytes:
    """One server-sent event carrying `obj`."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def chunk(kind: str, model_id: str, rid: str, created: int, text, ev: TokenEvent | None = None, offset: int = 0,
          finish: str | None = None) -> dict:
    """One streamed piece of a `kind` ("chat", "text" or "infill") answer."""
    if kind == "infill":
        out: dict[str, Any] = {"content": text, "stop": finish is not None}
        if ev is not None and ev.logprob is not None:
            out["completion_probabilities"] = [{"token": ev.piece, "logprob": ev.logprob,
                                                "top_logprobs": [{"token": t, "logprob": v}
                                                                 for t, v in ev.top_logprobs or []]}]
        return out
    finish = {"cancelled": "stop", "error": "stop"}.get(finish, finish) if finish else None
    if kind == "chat":
        delta = text if isinstance(text, dict) else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                                  "logprobs": chat_logprobs([ev]) if ev is not None and ev.logprob is not None
                                  else None}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_id,
                "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": finish,
              "logprobs": text_logprobs([ev], offset) if ev is not None and ev.logprob is not None else None}
    return {"id": rid, "object": "text_completion", "created": created, "model": model_id,
            "choices": [choice]}


def chat_logprobs(events: list[TokenEvent]) -> dict:
    return {"content": [{"token": e.piece, "logprob": e.logprob, "bytes": list((e.piece or "").encode()),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                          for t, v in e.top_logprobs or []]}
                        for e in events if e.logprob is not None]}


def text_logprobs(events: list[TokenEvent], offset: int = 0) -> dict:
    evs = [e for e in events if e.logprob is not None]
    offs, o = [], offset
    for e in evs:
        offs.append(o)
        o += len(e.piece or "")
    return {"tokens": [e.piece for e in evs], "token_logprobs": [e.logprob for e in evs],
            "top_logprobs": [dict(e.top_logprobs or []) for e in evs], "text_offset": offs}


def usage(res: GenerationResult) -> dict:
    """OpenAI's usage object; the prompt tokens read from a slot's cache are `cached_tokens`, drafted
    tokens the model accepted `accepted_prediction_tokens` and the rejected ones
    `rejected_prediction_tokens`, as OpenAI reports prompt caching and predicted outputs."""
    return {"prompt_tokens": res.n_prompt_tokens, "completion_tokens": res.n_tokens,
            "total_tokens": res.n_prompt_tokens + res.n_tokens,
            "prompt_tokens_details": {"cached_tokens": res.n_cached_prompt_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": res.n_accepted_tokens,
                                          "rejected_prediction_tokens": res.n_drafted_tokens - res.n_accepted_tokens}}


def final(kind: str, model_id: str, rid: str, res: GenerationResult, events: list[TokenEvent],
          shape: ChatOutput | None = None) -> dict:
    """The whole (not streamed) answer of a `kind` request."""
    extra = {"a3b": {"low_confidence_spans": [s.as_dict() for s in res.spans], "seed": res.seed,
                     "time_to_first_token": res.time_to_first_token, "context_full": res.context_full}}
    finish = {"cancelled": "stop", "error": "stop"}.get(res.finish_reason, res.finish_reason)
    if kind == "infill":
        return {"content": res.text, "stop": True, "model": model_id, **infill_tail(res), **extra}
    if kind == "chat":
        message, finish = shape.message(res) if shape is not None else ({"role": "assistant", "content": res.text},
                                                                        finish)
        finish = {"cancelled": "stop", "error": "stop"}.get(finish, finish)
        extra["a3b"].update(shape.extra(res) if shape is not None else {})
        choice = {"index": 0, "message": message, "finish_reason": finish,
                  "logprobs": chat_logprobs(events) if any(e.logprob is not None for e in events) else None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": res.text, "finish_reason": finish,
                  "logprobs": text_logprobs(events) if any(e.logprob is not None for e in events) else None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model_id,
            "choices": [choice], "usage": usage(res), **extra}


def infill_tail(res: GenerationResult) -> dict:
    """llama-server's counts and timings at the end of an /infill answer."""
    return {"tokens_predicted": res.n_tokens, "tokens_evaluated": res.n_prompt_tokens,
            "tokens_cached": res.n_cached_prompt_tokens, "truncated": False,
            "stop_type": {"length": "limit", "stop": "eos"}.get(res.finish_reason, res.finish_reason),
            "timings": {"prompt_n": res.n_prompt_tokens - res.n_cached_prompt_tokens,
                        "prompt_ms": res.time_to_first_token * 1000, "predicted_n": res.n_tokens,
                        "predicted_ms": res.decode_time * 1000, "predicted_per_second": res.tokens_per_second}}
