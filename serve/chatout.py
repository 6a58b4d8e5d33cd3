"""The shape of a chat answer: `reasoning_content` beside `content` (as llama-server and vLLM send
it), `tool_calls` read back from the answer's text, and what the a3b block adds (the request's
fields are read by serve/protocol/chat.py).
"""
from __future__ import annotations

from typing import Any

from ..runtime.generation import GenerationResult, TokenEvent
from .tools import ToolCallStream, split_answer


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


__all__ = ["ChatOutput"]
