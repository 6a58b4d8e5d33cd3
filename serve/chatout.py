"""The chat endpoint's fields for thinking models, structured output and tools, and the shape of its
answer: `reasoning_content` beside `content` (as llama-server and vLLM send it), `tool_calls`.

Request fields read here (each refused with a 400 when it does not fit, never ignored):

* `reasoning_effort` (OpenAI): "none" switches thinking off, the others on; it also reaches the
  template as the variable of that name (gpt-oss reads it). `think` (Ollama): true/false, or an
  effort. `chat_template_kwargs`: template variables (enable_thinking for the Qwen templates).
* `reasoning_budget`, `max_total_tokens`: the runtime's options of the same names (options.py).
* `response_format`: {"type": "text"}, {"type": "json_object"} (optionally with llama-server's
  "schema"), {"type": "json_schema", "json_schema": {"schema": ...}}; llama-server's `json_schema`
  and `grammar` fields too.
* `tools` and `tool_choice` ("auto" or "none"; forcing a call is refused as unsupported).
"""
from __future__ import annotations

from typing import Any

from ..runtime import options as opt
from ..runtime.errors import InvalidRequest
from ..runtime.generation import GenerationResult, TokenEvent
from ..runtime.options import check
from .fields import int_field
from .tools import ToolCallStream, split_answer

EFFORTS = ("none", "minimal", "low", "medium", "high")


def _effort(value: Any, field: str) -> str:
    if value not in EFFORTS:
        raise InvalidRequest(f"{field} must be one of {', '.join(EFFORTS)}; got {value!r}")
    return value


def chat_options(body: dict) -> tuple[dict, dict, tuple[dict, ...]]:
    """(template variables, the runtime's request settings, tools) of a chat body."""
    variables = body.get("chat_template_kwargs") or {}
    if not isinstance(variables, dict):
        raise InvalidRequest("chat_template_kwargs must be an object of template variables.")
    variables = dict(variables)
    opts: dict[str, Any] = {}
    effort = body.get("reasoning_effort")
    think = body.get("think")
    if think is not None:
        if isinstance(think, bool):
            opts["thinking"] = "on" if think else "off"
        else:
            effort = _effort(think, "think")
    if effort is not None:
        effort = _effort(effort, "reasoning_effort")
        opts["thinking"] = "off" if effort == "none" else "on"
        if effort != "none":
            variables.setdefault("reasoning_effort", effort)
    for option in (opt.REASONING_BUDGET, opt.MAX_TOTAL_TOKENS):
        if body.get(option.name) is not None:
            opts[option.name] = int_field(body, option.name, option)
    schema = response_schema(body)
    if schema is not None:
        opts["json_schema"] = schema
    if body.get("grammar") is not None:
        opts["grammar"] = body["grammar"]
    tools = tools_of(body)
    if tools and ("json_schema" in opts or "grammar" in opts):
        raise InvalidRequest("tools and a response_format (or grammar) together are not supported: the grammar "
                             "would keep the model from calling a tool. Give one of them.")
    return variables, opts, tools


def text_options(body: dict) -> dict:
    """The structured-output settings of a text completion (llama-server's json_schema and grammar,
    or response_format); tools need a chat."""
    if body.get("tools"):
        raise InvalidRequest("tools need the chat endpoint (/v1/chat/completions).")
    for name in ("reasoning_budget", "max_total_tokens", "reasoning_effort", "think", "chat_template_kwargs"):
        if body.get(name) is not None:   # a text completion renders no template: nothing could honour them
            raise InvalidRequest(f"{name} applies to chat requests (/v1/chat/completions), not to a text completion.")
    opts: dict[str, Any] = {}
    schema = response_schema(body)
    if schema is not None:
        opts["json_schema"] = schema
    if body.get("grammar") is not None:
        opts["grammar"] = body["grammar"]
    return opts


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


class ChatOutput:
    """One chat answer's deltas and message: reasoning apart, tool calls parsed when tools were offered."""

    def __init__(self, tools: bool):
        self.calls = ToolCallStream() if tools else None
        #: where a routed request went (runtime/routing.py Decision.as_dict), for the a3b block
        self.route: dict | None = None

    def deltas(self, ev: TokenEvent) -> list[dict]:
        out: list[dict] = []
        if ev.reasoning:
            out.append({"reasoning_content": ev.reasoning})
        if self.calls is None:
            if ev.text or ev.piece is not None:
                out.append({"content": ev.text})
            return out
        return out + self._shape(self.calls.feed(ev.text))

    def _shape(self, parts: list[tuple[str, Any]]) -> list[dict]:
        return [{"content": p} if kind == "content" else {"tool_calls": [p]} for kind, p in parts]

    def last_deltas(self) -> list[dict]:
        return self._shape(self.calls.flush()) if self.calls is not None else []

    def finish(self, reason: str) -> str:
        return "tool_calls" if self.calls is not None and self.calls.calls and reason == "stop" else reason

    def message(self, res: GenerationResult) -> tuple[dict, str]:
        """(the assistant message, finish reason) of a whole answer."""
        msg: dict[str, Any] = {"role": "assistant", "content": res.text}
        if res.reasoning:
            msg["reasoning_content"] = res.reasoning
        if self.calls is None:
            return msg, res.finish_reason
        content, calls, errors = split_answer(res.text)
        self.calls.errors = errors
        for i, c in enumerate(calls):
            c["index"] = i
        if calls:
            msg["content"] = content.strip() or None
            msg["tool_calls"] = calls
        self.calls.calls = calls
        return msg, self.finish(res.finish_reason)

    def extra(self, res: GenerationResult) -> dict:
        """What the a3b block of the answer adds for thinking models and tools."""
        out: dict[str, Any] = {}
        if res.reasoning or res.n_reasoning_tokens:
            out.update(reasoning_tokens=res.n_reasoning_tokens, reasoning_closed_by=res.reasoning_closed_by,
                       reasoning_spans=[s.as_dict() for s in res.reasoning_spans])
        if res.warnings:
            out["warnings"] = list(res.warnings)
        if self.calls is not None and self.calls.errors:
            out["tool_call_errors"] = list(self.calls.errors)
        if self.route is not None:
            out["route"] = self.route
        return out


__all__ = ["ChatOutput", "chat_options", "messages_with_tools", "response_schema", "text_options", "tools_of"]
