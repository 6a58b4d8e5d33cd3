"""Thinking models over the fake engine: reasoning streamed apart, the template's switch, the budget
closed inside the batched scheduler, the answer's grammar, tools through the template, bad input.

The fake thinking model (fakeengine.py, `think=`) writes its block byte by byte, so every tag is
split across tokens, and what it writes follows the sequence: a block the runtime closes is
answered like one the model closed.
"""
from __future__ import annotations

import math
import threading

import pytest

from comfyui_a3b.runtime import ChatPrompt, ConfidenceConfig, InvalidRequest, Runtime, preset

GREEDY = preset("greedy")
NO_CONF = ConfidenceConfig(enabled=False)
QWEN = "fake://qwen?template=qwen3&think=I+add+2+and+2.&text=It+is+4.&eos_after=50"
LOOP = "fake://loop?template=qwen3&think=Hmm,+again.&think_loop=1&text=Answer.+"


@pytest.fixture
def rt(fake_engine):
    r = Runtime()
    yield r
    r.unload()


def run(rt, model, prompt="What is 2 + 2?", **kw):
    kw.setdefault("sampling", GREEDY)
    kw.setdefault("confidence", NO_CONF)
    s = rt.submit(prompt, model=model, **kw)
    events = list(s)
    return s.result(), events


def test_reasoning_streams_apart_from_the_answer(rt):
    res, events = run(rt, QWEN)
    assert res.reasoning == "I add 2 and 2."
    assert res.text.startswith("It is 4.")
    assert "".join(e.reasoning for e in events) == res.reasoning
    assert "".join(e.text for e in events) == res.text
    assert not any("<" in e.text or "<" in e.reasoning for e in events)
    assert res.reasoning_closed_by == "model" and res.n_reasoning_tokens == len("\nI add 2 and 2.\n</think>")


def test_thinking_off_sets_the_template_switch(rt):
    m = rt.load(QWEN)
    off = m.render_chat(ChatPrompt(({"role": "user", "content": "Hi"},), variables={"enable_thinking": False}))
    assert off.endswith("<think>\n\n</think>\n\n")
    res, _ = run(rt, QWEN, thinking="off")
    assert res.reasoning == "" and res.text.startswith("It is 4.") and res.warnings == []
    assert res.n_prompt_tokens == len(m.prompt_tokens(ChatPrompt(({"role": "user", "content": "What is 2 + 2?"},),
                                                                 variables={"enable_thinking": False})))


def test_a_caller_variable_that_contradicts_thinking_is_refused(rt):
    with pytest.raises(InvalidRequest, match="contradicts"):
        rt.submit("Hi", model=QWEN, thinking="on", variables={"enable_thinking": False})


def test_template_opening_the_block_in_the_prompt(rt):
    """DeepSeek-R1 style: the output starts inside the block; off closes it before the first token."""
    r1 = "fake://r1?template=r1&think=Deep.&text=Ans.&eos_after=30"
    res, _ = run(rt, r1)
    assert (res.reasoning, res.text[:4]) == ("Deep.", "Ans.")
    res, _ = run(rt, r1, thinking="off")
    assert res.reasoning == "" and res.text.startswith("Ans.") and res.reasoning_closed_by == "budget"
    assert res.n_reasoning_tokens == 0
    assert any("no switch" in w for w in res.warnings)   # a warning, not an error


def test_thinking_on_without_a_switch_warns(rt):
    res, _ = run(rt, "fake://r1b?template=r1&think=Deep.&text=Ans.&eos_after=30", thinking="on")
    assert res.reasoning == "Deep." and any("no thinking switch" in w for w in res.warnings)


@pytest.mark.parametrize("budget", [1, 7, 25])
def test_budget_closes_the_block_at_exactly_n_tokens(rt, budget):
    res, events = run(rt, LOOP, reasoning_budget=budget, max_tokens=8)
    assert res.n_reasoning_tokens == budget           # overshoot 0
    assert res.reasoning_closed_by == "budget"
    assert res.text == "Answer. "[:8] and res.finish_reason == "length"   # max_tokens counts the answer
    assert "".join(e.reasoning for e in events) == res.reasoning


def test_budget_zero_is_thinking_off_where_the_template_allows(rt):
    res, _ = run(rt, LOOP, reasoning_budget=0, max_tokens=7)
    assert (res.reasoning, res.text, res.reasoning_closed_by) == ("", "Answer.", None)


def test_budget_with_the_model_opening_the_block(rt):
    """A template without a switch whose model opens <think> itself: budget 0 closes it at the open."""
    res, _ = run(rt, "fake://h0?template=harmony&think=Analysis.&think_loop=1&text=Final.", reasoning_budget=0,
                 max_tokens=6)
    assert (res.reasoning, res.text, res.n_reasoning_tokens) == ("", "Final.", 0)
    res, _ = run(rt, "fake://h1?template=harmony&think=Analysis.&think_loop=1&text=Final.", reasoning_budget=4,
                 max_tokens=6)
    assert (res.reasoning, res.text, res.n_reasoning_tokens) == ("Anal", "Final.", 4)


def test_total_limit_bounds_reasoning_and_answer(rt):
    res, _ = run(rt, LOOP, max_total_tokens=30)
    assert res.n_tokens == 30 and res.finish_reason == "length" and res.text == ""
    # 7 tokens open the block, 5 reason, the closing text is injected (not sampled), 4 answer
    res, _ = run(rt, LOOP, reasoning_budget=5, max_total_tokens=16, max_tokens=100)
    assert (res.finish_reason, res.n_reasoning_tokens, res.text) == ("length", 5, "Answ")


def test_budget_leaves_other_requests_undisturbed(rt):
    """Two requests batched together, one closed by its budget: the other writes what it writes alone
    (the fake checks every sequence's KV cache on every decode)."""
    ref = LOOP + "&delay_ms=2"
    alone, _ = run(rt, ref, max_total_tokens=60)
    out: dict = {}

    def go(name, **kw):
        out[name] = run(rt, ref, **kw)[0]

    ts = [threading.Thread(target=go, args=("budget",), kwargs=dict(reasoning_budget=3, max_tokens=20)),
          threading.Thread(target=go, args=("plain",), kwargs=dict(max_total_tokens=60))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert out["plain"].reasoning == alone.reasoning and out["plain"].n_tokens == 60
    assert out["budget"].n_reasoning_tokens == 3 and out["budget"].text.startswith("Answer.")
    m = rt.load(ref)
    assert max(m.backend.batch_sizes) > 1   # they did decode in one batch


def test_grammar_applies_to_the_answer_only(rt):
    ref = "fake://g?template=qwen3&think=Plan.&text={}&eos_after=30"
    res, _ = run(rt, ref, json_schema={"type": "object"})
    assert res.reasoning == "Plan."
    starts = rt.load(ref).backend.grammar_starts
    assert starts == ["<think>\nPlan.\n</think>"]   # the grammar came in when the block ended
    run(rt, ref, json_schema={"type": "object"}, thinking="off")
    assert starts[-1] == "<think>\n\n</think>\n\n"    # thinking off: from the first answer token


def test_grammar_from_the_first_token_without_thinking(rt):
    ref = "fake://plain?text={}&eos_after=4"
    run(rt, ref, grammar='root ::= "{}"')
    assert rt.load(ref).backend.grammar_starts == [""]


@pytest.mark.parametrize("schema,match", [({"type": "nonsense"}, "does not compile"),
                                          ({"$ref": "#/definitions/x"}, "does not compile"),
                                          ({"$ref": "https://example.invalid/s.json"}, "does not compile"),
                                          ("not a schema", "JSON object"),
                                          ({"type": "number", "minimum": math.nan}, "plain JSON")])
def test_bad_schemas_are_refused_with_a_reason(rt, schema, match):
    with pytest.raises(InvalidRequest, match=match):
        rt.submit("Hi", model=QWEN, json_schema=schema)


@pytest.mark.parametrize("budget", [-1, math.nan, 1.5, "5", True, 1 << 30])
def test_bad_budgets_are_refused(rt, budget):
    with pytest.raises(InvalidRequest, match="reasoning_budget"):
        rt.submit("Hi", model=QWEN, reasoning_budget=budget)


def test_bad_thinking_values_are_refused(rt):
    with pytest.raises(InvalidRequest, match="thinking must be one of"):
        rt.submit("Hi", model=QWEN, thinking="maybe")
    with pytest.raises(InvalidRequest, match="contradicts itself"):
        rt.submit("Hi", model=QWEN, thinking="on", reasoning_budget=0)
    with pytest.raises(InvalidRequest, match="max_total_tokens"):
        rt.submit("Hi", model=QWEN, max_total_tokens=0)
    with pytest.raises(InvalidRequest, match="not both"):
        rt.submit("Hi", model=QWEN, json_schema={"type": "object"}, grammar='root ::= "x"')


def test_tools_go_through_the_template(rt):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    m = rt.load(QWEN)
    text = m.render_chat(ChatPrompt(({"role": "user", "content": "Weather?"},), tools=tuple(tools)))
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    with pytest.raises(InvalidRequest, match="no tool support"):
        rt.submit("Weather?", model="fake://chatml", tools=tools)
    with pytest.raises(InvalidRequest, match=r"tools\[0\]"):
        rt.submit("Weather?", model=QWEN, tools=[{"type": "function"}])


def test_text_prompts_are_not_split(rt):
    res, _ = run(rt, "fake://t?text=<think>x</think>y&eos_after=17", "go on", chat=False)
    assert res.text == "<think>x</think>y" and res.reasoning == ""
