"""`POST /v1/chat/completions`: the chat request, read once from its JSON body.

Besides the shared fields (common.py), a chat reads (each refused with a 400 when it does not fit,
never ignored):

* `messages`: text content, or OpenAI's content parts (text, and images as `image_url` data URLs:
  the server fetches nothing); tool turns keep their `tool_calls`, `tool_call_id` and `name`.
* `reasoning_effort` (OpenAI): "none" switches thinking off, the others on; it also reaches the
  template as the variable of that name (gpt-oss reads it). `think` (Ollama): true/false, or an
  effort. `chat_template_kwargs`: template variables (enable_thinking for the Qwen templates).
* `reasoning_budget`, `max_total_tokens`: the runtime's options of the same names (runtime/options/).
* `response_format`: {"type": "text"}, {"type": "json_object"} (optionally with llama-server's
  "schema"), {"type": "json_schema", "json_schema": {"schema": ...}}; llama-server's `json_schema`
  and `grammar` fields too.
* `tools` and `tool_choice` ("auto" or "none"; forcing a call is refused as unsupported).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...runtime.errors import InvalidRequest
from ...runtime.images import from_data_url
from ...runtime.requests import ChatPrompt
from .common import Generation, Structured, generation_of, structured_of
from .fields import F

EFFORTS = ("none", "minimal", "low", "medium", "high")


@dataclass(frozen=True)
class ChatRequest:
    #: the checked messages, template variables and tools
    prompt: ChatPrompt
    gen: Generation
    structured: Structured = Structured()
    #: "on" or "off" when the request switches thinking, else None (the runtime's default)
    thinking: str | None = None
    reasoning_budget: int | None = None
    max_total_tokens: int | None = None

    @property
    def tools(self) -> tuple[dict, ...]:
        return self.prompt.tools

    def settings(self) -> dict:
        """Runtime.submit's keywords of this chat."""
        out = {**self.gen.settings(), **self.structured.settings()}
        for name in ("thinking", "reasoning_budget", "max_total_tokens"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def parse_chat(body: dict) -> ChatRequest:
    """The chat request of a JSON body, or InvalidRequest naming the field that does not fit."""
    variables = body.get("chat_template_kwargs") or {}
    if not isinstance(variables, dict):
        raise InvalidRequest("chat_template_kwargs must be an object of template variables.")
    variables = dict(variables)
    thinking = None
    effort = body.get("reasoning_effort")
    think = body.get("think")
    if think is not None:
        if isinstance(think, bool):
            thinking = "on" if think else "off"
        else:
            effort = _effort(think, "think")
    if effort is not None:
        effort = _effort(effort, "reasoning_effort")
        thinking = "off" if effort == "none" else "on"
        if effort != "none":
            variables.setdefault("reasoning_effort", effort)
    budget, total = F["reasoning_budget"].integer(body), F["max_total_tokens"].integer(body)
    structured = structured_of(body)
    tools = tools_of(body)
    if tools and structured.given:
        raise InvalidRequest("tools and a response_format (or grammar) together are not supported: the grammar "
                             "would keep the model from calling a tool. Give one of them.")
    prompt = ChatPrompt(messages_with_tools(body, messages_of(body)), variables=variables, tools=tools)
    return ChatRequest(prompt, generation_of(body, chat=True), structured, thinking, budget, total)


def _effort(value: Any, field: str) -> str:
    if value not in EFFORTS:
        raise InvalidRequest(f"{field} must be one of {', '.join(EFFORTS)}; got {value!r}")
    return value


def tools_of(body: dict) -> tuple[dict, ...]:
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    if tools is None:
        if choice not in ("auto", "none", None):
            raise InvalidRequest("tool_choice needs tools.")
        return ()
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects.")
    if choice in ("none",):
        return ()
    if choice not in ("auto", None):
        raise InvalidRequest(f"tool_choice {choice!r} is not supported: this server lets the model choose "
                             "(\"auto\") or offers no tools (\"none\").")
    return tuple(tools)


def message_list(body: dict) -> list[dict]:
    """A request's `messages`: a non-empty list of objects with a string role (OpenAI's and Ollama's
    chats alike); what their content may be is each API's own."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects.")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string role.")
    return msgs


def messages_of(body: dict) -> list[dict]:
    """The chat messages of a request: text content, or OpenAI's content parts (text, and images as
    `image_url` data URLs: the server fetches nothing)."""
    out = []
    for i, m in enumerate(message_list(body)):
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


def messages_with_tools(body: dict, msgs: list[dict]) -> list[dict]:
    """The checked messages, with what tool turns carry beside content (the assistant's tool_calls,
    a tool answer's tool_call_id and name), for templates that render them."""
    raw = body.get("messages") or []
    out = []
    for m, r in zip(msgs, raw):
        m = dict(m)
        calls = r.get("tool_calls") if isinstance(r, dict) else None
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise InvalidRequest("tool_calls must be a list of {\"function\": {\"name\", \"arguments\"}} objects.")
            m["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if isinstance(r, dict) and isinstance(r.get(key), str):
                m[key] = r[key]
        out.append(m)
    return out


__all__ = ["ChatRequest", "EFFORTS", "content_parts_of", "messages_of", "messages_with_tools", "parse_chat",
           "tools_of"]
