"""What travels to and from an OpenAI-compatible server: the request body for each kind of prompt,
each streamed event's text, log-probabilities and end (checked field by field, so that a server
that sends something else gets one clear error), embedding answers, and the token estimate for
servers without a tokenize endpoint.

Prompts map to endpoints as follows:

* `ChatPrompt` -> `/v1/chat/completions` with its messages, so the server applies the model's own
  template; template variables travel as `chat_template_kwargs` (llama-server, vLLM, SGLang); a
  message with images as OpenAI's content parts (text, and `image_url` with a data URL: a file's
  bytes as they are, pixels as PNG). A named llama.cpp template is applied here instead, and the
  text completed (a prompt with images cannot go that way);
* `InfillPrompt` -> llama-server's `/infill` (prefix, suffix, the middle as `prompt`, the chunks as
  `input_extra`) where the server has it and its model fills in (probe.py), else the completion
  of `chunks prefix middle`;
* `TextPrompt` -> `/v1/completions` with the text (the server tokenizes it on its own terms: BOS
  and special tokens as it does for any client); `TokenPrompt` -> the same with the token list.
"""
from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from .. import chat as chatmod
from .. import fim, thinking
from ..errors import InvalidRequest, RemoteProtocolError
from ..images import data_url
from ..requests import ChatPrompt, GenerationRequest, ImagePart, InfillPrompt, Prompt, TokenPrompt, prompt_images
from ..requests import prompt_texts

#: Pieces as a pre-tokenizer cuts text: a word (or up to 8 letters of one) with its leading space, up
#: to 3 digits, one punctuation mark, a run of spaces. Their count is the token estimate for servers
#: without a tokenize endpoint (about 1-1.5 real tokens per piece for English text and code).
_PIECE = re.compile(r" ?[^\W\d_]{1,8}| ?\d{1,3}| ?[^\w\s]|\s+(?!\S)|\s|.", re.S)
#: Tokens a chat template adds around each message (role markers, separators), for the estimate.
CHAT_TOKENS_PER_MESSAGE = 4
#: Tokens an image takes on a server, for the estimate: Qwen-VL's at 448x448 and Gemma 3's are 256
#: (a server resizes each image to its model's own size; LLaVA-1.5 takes 576)
IMAGE_TOKENS_ESTIMATE = 256

#: (log-probability of the sampled token, the top alternatives as (text, log-probability))
Logprobs = tuple[float, list[tuple[str, float]]]


def estimate_tokens(text: str) -> int:
    """About the number of tokens of `text` (see _PIECE), without a tokenizer."""
    return sum(1 for _ in _PIECE.finditer(text))


def embedded_tokens(out: Any, texts: list[str]) -> int:
    """The input tokens an /embeddings answer reports (`usage.prompt_tokens`), else an estimate."""
    usage = out.get("usage") if isinstance(out, dict) else None
    n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return n
    return sum(estimate_tokens(t) for t in texts)


def estimate_prompt(prompt: Prompt) -> int:
    """About the number of tokens `prompt` takes on a server whose tokenizer is not at hand."""
    if isinstance(prompt, TokenPrompt):
        return len(prompt.tokens)
    n = sum(estimate_tokens(t) for t in prompt_texts(prompt))
    if isinstance(prompt, ChatPrompt):
        n += CHAT_TOKENS_PER_MESSAGE * len(prompt.messages) + IMAGE_TOKENS_ESTIMATE * len(prompt_images(prompt))
    return n


def wire_message(m: dict) -> dict:
    """A chat message as the OpenAI API takes it: text content as it is, content parts as a list."""
    content = m["content"]
    if isinstance(content, str):
        return dict(m)
    parts = [{"type": "image_url", "image_url": {"url": data_url(p)}} if isinstance(p, ImagePart)
             else {"type": "text", "text": p} for p in content]
    return {**m, "content": parts}


def request_body(req: GenerationRequest, model: str, infill: bool) -> tuple[str, bool, dict]:
    """(path, whether it is at the server root rather than under /v1, JSON body) for `req`."""
    sp = req.sampling
    body: dict[str, Any] = {
        "model": model, "max_tokens": req.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
        "top_k": sp.top_k, "min_p": sp.min_p, "repeat_penalty": sp.repeat_penalty,
        "repeat_last_n": sp.repeat_last_n, "stream": True,
    }
    # llama-server's fields, sent only where they change something
    if sp.ignore_eos:
        body["ignore_eos"] = True
    if sp.samplers is not None:
        body["samplers"] = list(sp.samplers)
    if req.n_indent:
        body["n_indent"] = req.n_indent
    if sp.seed is not None:
        body["seed"] = sp.seed
    if req.stop:
        body["stop"] = list(req.stop)
    n_top = req.logprobs if req.logprobs is not None else (5 if req.confidence.enabled else None)
    p = req.prompt
    if not isinstance(p, ChatPrompt):   # llama-server's fields for text and infill (a chat sends response_format)
        if req.json_schema is not None:
            body["json_schema"] = dict(req.json_schema)
        if req.grammar is not None:
            body["grammar"] = req.grammar
    if isinstance(p, InfillPrompt):
        if not infill:
            return _completion(body, fim.chunks_text(p) + p.prefix + p.middle, n_top)
        body.update(input_prefix=p.prefix, input_suffix=p.suffix, prompt=p.middle, n_predict=req.max_tokens,
                    input_extra=[{"filename": c.filename, "text": c.text} for c in p.chunks])
        if n_top:
            body["n_probs"] = n_top
        return "/infill", True, body
    if isinstance(p, ChatPrompt):
        if p.template:
            if prompt_images(p):
                raise InvalidRequest("A named chat template renders text only; a prompt with images goes to the "
                                     "server's own template. Leave the template empty.")
            text = chatmod.render(list(p.messages), gguf_template=None, template=p.template, bos="", eos="")
            return _completion(body, text, n_top)
        body["messages"] = [wire_message(m) for m in p.messages]
        variables = thinking_variables(req, p)
        if variables:
            body["chat_template_kwargs"] = variables
        if req.max_total_tokens is not None:
            body["max_tokens"] = req.max_total_tokens   # the server counts reasoning and answer together
        if req.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer",
                                                                            "schema": dict(req.json_schema)}}
        if req.grammar is not None:
            body["grammar"] = req.grammar   # llama-server's field
        if p.tools:
            body["tools"] = [dict(t) for t in p.tools]
        if n_top is not None:
            body.update(logprobs=True, top_logprobs=n_top)
        return "/chat/completions", False, body
    return _completion(body, list(p.tokens) if isinstance(p, TokenPrompt) else p.text, n_top)


def thinking_variables(req: GenerationRequest, p: ChatPrompt) -> dict:
    """The template variables sent: the prompt's own, and enable_thinking for thinking on or off
    (llama-server and vLLM pass it to the Qwen templates). A server decodes on its own, so a budget
    of N tokens cannot be kept there: only 0 (thinking off) is."""
    variables = dict(p.variables)
    if req.reasoning_budget not in (None, 0):
        raise InvalidRequest("A remote server decodes on its own, so a reasoning budget cannot close its block; "
                             "give reasoning_budget 0 (thinking off) or none, or max_total_tokens to bound both.")
    off = thinking.asks_off(req)
    if req.thinking != "auto" or off:
        thinking.switch(variables, "enable_thinking", off)
    return variables


def reasoning_delta(ev: dict, where: str) -> str:
    """The reasoning text of a streamed chat event: `reasoning_content` (llama-server, vLLM before
    0.10) or `reasoning` (later vLLM), "" when it has none."""
    choices = ev.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    d = choices[0].get("delta")
    if not isinstance(d, dict):
        return ""
    f = _Fields(where)
    return f.get(d, "reasoning_content", str, "text") or f.get(d, "reasoning", str, "text") or ""


def _completion(body: dict, prompt: str | list[int], n_top: int | None) -> tuple[str, bool, dict]:
    body["prompt"] = prompt
    if n_top is not None:
        body["logprobs"] = n_top
    return "/completions", False, body


# -- streamed events ----------------------------------------------------------------------------------
class _Fields:
    """Typed reads of one event's fields: a field of another type is a RemoteProtocolError."""

    def __init__(self, where: str):
        self.where = where

    def bad(self, what: str, v: Any, want: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"The server at {self.where} sent an event whose {what} is "
                                   f"{type(v).__name__} {str(v)[:40]!r}, not {want}.")

    def get(self, obj: dict, key: str, kind: type, want: str) -> Any:
        """obj[key] if it is a `kind` (text, a list, an object), None if it is missing or null."""
        v = obj.get(key)
        if v is not None and not isinstance(v, kind):
            raise self.bad(repr(key), v, want)
        return v

    def num(self, v: Any, what: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise self.bad(what, v, "a number")
        return float(v)

    def top(self, items: Any, what: str) -> list[tuple[str, float]]:
        """[{"token": str, "logprob": number}, ...] (or llama-server's {"prob": number})."""
        if items is None:
            return []
        if not isinstance(items, list):
            raise self.bad(what, items, "a list")
        out = []
        for t in items:
            if not isinstance(t, dict):
                raise self.bad(what, t, "an object")
            tok = self.get(t, "token", str, "text") or ""
            if "logprob" in t:
                out.append((tok, self.num(t["logprob"], "logprob")))
            else:
                out.append((tok, math.log(max(self.num(t.get("prob", 1e-9), "prob"), 1e-9))))
        return out


def delta(ev: dict, where: str) -> tuple[str, Logprobs | None, str | None]:
    """(new text, log-probabilities or None, finish reason) of one streamed event: a completion, a
    chat completion, or llama-server's native format (/infill)."""
    f = _Fields(where)
    choices = f.get(ev, "choices", list, "a list")
    if choices is not None:
        if not choices:
            return "", None, None
        c = choices[0]
        if not isinstance(c, dict):
            raise f.bad("choice", c, "an object")
        finish = f.get(c, "finish_reason", str, "text")
        d = f.get(c, "delta", dict, "an object")
        if d is not None:
            text = f.get(d, "content", str, "text") or ""
            lp = f.get(c, "logprobs", dict, "an object") or {}
            content = f.get(lp, "content", list, "a list")
            if content:
                first = content[0]
                if not isinstance(first, dict):
                    raise f.bad("logprobs entry", first, "an object")
                return text, (f.num(first.get("logprob", 0.0), "logprob"),
                              f.top(first.get("top_logprobs"), "top_logprobs")), finish
            return text, None, finish
        text = f.get(c, "text", str, "text") or ""
        lp = f.get(c, "logprobs", dict, "an object")
        tops = f.get(lp, "top_logprobs", list, "a list") if lp else None
        if tops:
            alts = tops[0] or {}
            if not isinstance(alts, dict):
                raise f.bad("top_logprobs entry", alts, "an object")
            chosen = (f.get(lp, "token_logprobs", list, "a list") or [0.0])[0]
            top = sorted(((str(k), f.num(v, "top logprob")) for k, v in alts.items()), key=lambda kv: -kv[1])
            return text, (f.num(chosen if chosen is not None else 0.0, "token logprob"), top), finish
        return text, None, finish
    if "content" in ev:
        text = f.get(ev, "content", str, "text") or ""
        probs = f.get(ev, "completion_probabilities", list, "a list")
        lp = None
        if probs:
            p = probs[0]
            if not isinstance(p, dict):
                raise f.bad("completion_probabilities entry", p, "an object")
            top = f.top(p.get("top_logprobs") if "top_logprobs" in p else p.get("probs"), "top_logprobs")
            lp = (f.num(p["logprob"], "logprob") if "logprob" in p else (top[0][1] if top else 0.0), top)
        return text, lp, ("stop" if ev.get("stop") else None)
    raise RemoteProtocolError(f"The server at {where} sent an event without choices or content: {str(ev)[:80]}")


def entropy_of(top: list[tuple[str, float]]) -> float | None:
    """Entropy (nats) estimated from the top alternatives' log-probabilities: their own terms, plus
    the probability left over counted as one more outcome (a lower bound of the true entropy; with 5
    alternatives it follows the local measure closely where it matters, a flat distribution)."""
    if not top:
        return None
    ps = [math.exp(v) for _, v in top if v is not None and math.isfinite(v)]
    h = -sum(p * math.log(p) for p in ps if p > 0)
    rest = 1.0 - sum(ps)
    if rest > 1e-9:
        h -= rest * math.log(rest)
    return h


# -- embeddings -----------------------------------------------------------------------------------------
def embedding_rows(out: Any, n: int, where: str) -> list[np.ndarray]:
    """The vectors of an /embeddings answer for `n` texts, in order: each a vector, or (a server's
    answer for a model without pooling) one vector per token; finite numbers only."""
    data = out.get("data") if isinstance(out, dict) else None
    if not isinstance(data, list) or len(data) != n or not all(isinstance(d, dict) for d in data):
        raise RemoteProtocolError(f"The server at {where} answered /embeddings without one vector per text.")
    rows = []
    for d in sorted(data, key=lambda d: d.get("index", 0) if isinstance(d.get("index", 0), int) else 0):
        try:
            v = np.asarray(d.get("embedding"), dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise RemoteProtocolError(f"The server at {where} answered /embeddings with something that is not a "
                                      f"vector ({e}).") from None
        if v.ndim not in (1, 2) or not v.size:
            raise RemoteProtocolError(f"The server at {where} answered /embeddings with an embedding that is neither "
                                      "a vector nor a list of token vectors.")
        if not np.isfinite(v).all():
            raise RemoteProtocolError(f"The server at {where} answered /embeddings with NaN or infinite values; "
                                      "the model or the server is broken.")
        rows.append(v)
    return rows


def pool(vec: np.ndarray, pooling: str) -> np.ndarray:
    """A pooled vector of one text: as given when the server pooled, else pooled here."""
    if vec.ndim == 1:
        return vec
    return vec.mean(axis=0) if pooling == "mean" else vec[0] if pooling == "cls" else vec[-1]


def stack(rows: list[np.ndarray], where: str) -> np.ndarray:
    """One matrix of the texts' vectors; vectors of different lengths are the server's error."""
    sizes = sorted({len(r) for r in rows})
    if len(sizes) > 1:
        raise RemoteProtocolError(f"The server at {where} answered /embeddings with vectors of different lengths "
                                  f"({', '.join(map(str, sizes[:4]))}); one model gives one length.")
    return np.stack(rows)
