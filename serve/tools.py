"""Tool calls read back from a model's answer: the Qwen / Hermes `<tool_call>{json}</tool_call>` form
into OpenAI `tool_calls`, while the answer streams.

`ToolCallStream.feed` takes the answer's text as it streams and gives back what to send: content
text (outside any call), finished calls, and calls whose JSON does not parse. A `<tool_call>` tag
split across tokens is held back until it is known; the text of a call is held until its closing
tag. A malformed call is never an error of the request: its raw text goes back as content, and the
answer is flagged (`a3b.tool_call_errors`), since what a model writes is not the client's fault.
Work is linear in the text: each piece is searched once, and a call's text once when it closes.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse_call(body: str) -> tuple[dict | None, str]:
    """(an OpenAI tool call, "") for the JSON between the tags, or (None, why it is not one)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"the call is not JSON ({e.msg} at character {e.pos})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, "the call has no function name"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, f"the arguments of {obj['name']} are not JSON"
    if not isinstance(args, dict):
        return None, f"the arguments of {obj['name']} are not a JSON object"
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}, ""


def _held(text: str) -> int:
    """Length of the end of `text` that may be the start of `<tool_call>`."""
    return next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:k])), 0)


@dataclass
class ToolCallStream:
    calls: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _buf: str = ""
    _inside: bool = False

    def feed(self, text: str) -> list[tuple[str, Any]]:
        """[("content", text) | ("call", tool call)] released by `text`."""
        self._buf += text
        out: list[tuple[str, Any]] = []
        while self._buf:
            if not self._inside:
                at = self._buf.find(OPEN)
                upto = at if at >= 0 else len(self._buf) - _held(self._buf)
                if upto:
                    out.append(("content", self._buf[:upto]))
                if at < 0:
                    self._buf = self._buf[upto:]
                    break
                self._buf, self._inside = self._buf[at:], True
            end = self._buf.find(CLOSE, len(OPEN))
            if end < 0:
                break
            raw, self._buf, self._inside = self._buf[:end + len(CLOSE)], self._buf[end + len(CLOSE):], False
            out.append(self._call(raw))
        return out

    def _call(self, raw: str) -> tuple[str, Any]:
        call, why = parse_call(raw[len(OPEN):-len(CLOSE)].strip())
        if call is None:
            self.errors.append(why)
            return "content", raw
        call["index"] = len(self.calls)
        self.calls.append(call)
        return "call", call

    def flush(self) -> list[tuple[str, Any]]:
        """At the end: a call never closed goes back as text, flagged."""
        rest, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            self.errors.append("a <tool_call> was never closed (the answer ended first)")
        return [("content", rest)] if rest else []


def split_answer(text: str) -> tuple[str, list[dict], list[str]]:
    """(content, tool calls, errors) of a whole answer."""
    s = ToolCallStream()
    parts = s.feed(text) + s.flush()
    return "".join(p for kind, p in parts if kind == "content"), s.calls, s.errors


__all__ = ["CLOSE", "OPEN", "ToolCallStream", "parse_call", "split_answer"]
