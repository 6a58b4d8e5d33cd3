"""`a3b serve` for thinking models, structured output and tools, over the fake engine (fast tier):
reasoning_content in messages and stream deltas, the thinking fields OpenAI-compatible clients
send, response_format, tools and tool_choice, and the remote engine reading reasoning back.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from urllib.parse import quote

import httpx
import pytest

from test_serve import sse

THINK = "fake://think?template=qwen3&think=I+add+2+and+2.&text=It+is+4.&eos_after=41"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


def scripted(text: str, **extra) -> str:
    q = "&".join(f"{k}={v}" for k, v in extra.items())
    return f"fake://tool?template=qwen3&text={quote(text)}&eos_after={len(text.encode())}" + (f"&{q}" if q else "")


@contextmanager
def serving(ref: str):
    from comfyui_a3b.runtime import get_runtime
    from comfyui_a3b.serve import Server

    rt = get_runtime()
    srv = Server(rt.spec(ref, n_parallel=2, n_ctx=1024), "127.0.0.1", 0).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=20, trust_env=False) as c:
            yield c, srv
    finally:
        srv.stop()
        rt.unload()


@pytest.fixture(scope="module")
def think(fake_engine):
    with serving(THINK) as (c, srv):
        yield c


def chat(c, **body):
    body.setdefault("messages", ASK)
    body.setdefault("temperature", 0)
    return c.post("/v1/chat/completions", json=body)


def test_reasoning_content_in_the_message(think):
    r = chat(think)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "I add 2 and 2." and msg["content"] == "It is 4."
    assert r.json()["a3b"]["reasoning_closed_by"] == "model"


def test_reasoning_content_in_stream_deltas(think):
    with think.stream("POST", "/v1/chat/completions", json={"messages": ASK, "stream": True, "temperature": 0}) as r:
        events = sse(r)
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (reasoning, content) == ("I add 2 and 2.", "It is 4.")
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_answer:])


@pytest.mark.parametrize("body", [{"reasoning_effort": "none"}, {"think": False},
                                  {"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_budget": 0}])
def test_thinking_off_fields(think, body):
    msg = chat(think, **body).json()["choices"][0]["message"]
    assert "reasoning_content" not in msg and msg["content"].startswith("It is 4.")


def test_reasoning_budget_field(think):
    out = chat(think, reasoning_budget=3, max_tokens=8).json()
    assert out["a3b"]["reasoning_tokens"] == 3 and out["a3b"]["reasoning_closed_by"] == "budget"
    assert out["choices"][0]["message"]["content"] == "It is 4."


@pytest.mark.parametrize("body,match", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"), ({"think": "sometimes"}, "think"),
    ({"reasoning_budget": -1}, "reasoning_budget"), ({"reasoning_budget": "NaN"}, "reasoning_budget"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "does not compile"),
    ({"tools": TOOLS, "tool_choice": "required"}, "not supported"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "not supported"),
    ({"tools": [{"type": "function"}]}, "tools"),
])
def test_bad_fields_are_400s(think, body, match):
    r = chat(think, **body)
    assert r.status_code == 400 and match in r.json()["error"]["message"], r.text


def test_response_format_reaches_the_grammar(think):
    from comfyui_a3b.runtime import get_runtime

    r = chat(think, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}})
    assert r.status_code == 200
    backend = get_runtime().load(get_runtime().spec(THINK, n_parallel=2, n_ctx=1024)).backend
    assert backend.grammar_starts[-1].endswith("</think>")   # the answer only


def test_tool_calls_parsed(fake_engine):
    with serving(scripted("Let me look. " + CALL)) as (c, _):
        out = chat(c, tools=TOOLS).json()
        ch = out["choices"][0]
        assert ch["finish_reason"] == "tool_calls"
        call = ch["message"]["tool_calls"][0]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
            "city": "Paris"}
        assert ch["message"]["content"] == "Let me look."
        with c.stream("POST", "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "stream": True,
                                                                   "temperature": 0}) as r:
            events = sse(r)
        deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert [tc["function"]["name"] for tc in calls] == ["get_weather"] and calls[0]["index"] == 0
        assert "<tool" not in "".join(d.get("content", "") for d in deltas)
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # without tools the same answer is plain text
        plain = chat(c).json()["choices"][0]
        assert plain["message"]["content"].endswith("</tool_call>") and "tool_calls" not in plain["message"]


def test_malformed_tool_json_is_text_with_a_flag(fake_engine):
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    with serving(scripted(bad)) as (c, _):
        r = chat(c, tools=TOOLS)
        assert r.status_code == 200
        out = r.json()
        assert out["choices"][0]["message"]["content"] == bad and out["choices"][0]["finish_reason"] == "stop"
        assert "not JSON" in out["a3b"]["tool_call_errors"][0]


def test_tool_turns_reach_the_template(fake_engine):
    with serving(scripted("It is sunny.")) as (c, _):
        msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        r = chat(c, messages=msgs, tools=TOOLS)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "It is sunny."
        # the assistant's tool call is rendered into the prompt, not dropped
        bare = [m if "tool_calls" not in m else {"role": "assistant", "content": None} for m in msgs]
        n_with = chat(c, messages=msgs, tools=TOOLS).json()["usage"]["prompt_tokens"]
        assert n_with > chat(c, messages=bare, tools=TOOLS).json()["usage"]["prompt_tokens"]


def test_template_without_tools_is_a_400(fake_engine):
    with serving("fake://plainchat?eos_after=4") as (c, _):
        r = chat(c, tools=TOOLS)
        assert r.status_code == 400 and "no tool support" in r.json()["error"]["message"]


def test_remote_engine_maps_reasoning_content(think, monkeypatch):
    """The remote engine over this server: reasoning_content comes back as the reasoning channel."""
    from comfyui_a3b.runtime import Runtime, preset

    rt = Runtime()
    url = str(think.base_url) + "/v1"
    try:
        s = rt.submit("What is 2 + 2?", model=url, sampling=preset("greedy"))
        events = list(s)
        res = s.result()
        assert (res.reasoning, res.text) == ("I add 2 and 2.", "It is 4.")
        assert "".join(e.reasoning for e in events) == res.reasoning
        off = rt.generate("What is 2 + 2?", model=url, thinking="off", sampling=preset("greedy"))
        assert off.reasoning == "" and off.text.startswith("It is 4.It is")
    finally:
        rt.unload()


@pytest.mark.parametrize("field", ["reasoning_budget", "max_total_tokens", "reasoning_effort", "think",
                                   "chat_template_kwargs"])
def test_chat_only_fields_on_a_text_completion_are_400s(think, field):
    """A text completion renders no chat template, so these fields could change nothing: refused,
    not silently dropped."""
    values = {"reasoning_effort": "low", "think": False, "chat_template_kwargs": {"enable_thinking": False}}
    value = values.get(field, 8)
    r = think.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
