"""Structured output and the reasoning budget on the real embedded model and real llama.cpp (slow tier).

The JSON-schema answers are parsed and validated against their schema (jsonschema). For the budget,
the embedded model gets a copy with a chat template that opens the reasoning block in the
generation prompt (DeepSeek-R1 style, tests/templates.py), so its output starts inside the block:
the runtime must close it at exactly N tokens, and the model answers after it.
"""
from __future__ import annotations

import json
import threading

import pytest

from comfyui_a3b.bench.common import with_chat_template
from comfyui_a3b.runtime import ConfidenceConfig, InvalidRequest, Runtime, preset
from templates import QWEN3, R1

pytestmark = pytest.mark.slow

GREEDY = preset("greedy")
PANELS = {"type": "array", "minItems": 2, "maxItems": 3, "items": {
    "type": "object", "required": ["panel", "scene", "dialogue"], "additionalProperties": False,
    "properties": {"panel": {"type": "integer", "minimum": 1}, "scene": {"type": "string", "maxLength": 80},
                   "dialogue": {"type": "string", "maxLength": 80}}}}


def validate(value, schema):
    import jsonschema

    jsonschema.validate(value, schema)


@pytest.fixture(scope="module")
def runtime():
    r = Runtime()
    yield r
    r.unload()


@pytest.fixture(scope="module")
def r1_model(tmp_path_factory, default_path):
    return str(with_chat_template(default_path, tmp_path_factory.mktemp("r1") / "smol-r1.gguf", R1))


def test_json_schema_answer_validates(runtime):
    res = runtime.generate("Write a two-panel storyboard about a cat who finds a key.", json_schema=PANELS,
                           max_tokens=300, sampling=GREEDY)
    assert res.finish_reason == "stop", res
    validate(json.loads(res.text), PANELS)


def test_json_object_with_sampling(runtime):
    schema = {"type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}}
    for seed in (1, 2, 3):
        res = runtime.generate("Describe a person as JSON.", json_schema=schema, max_tokens=120,
                               sampling=preset("creative", seed=seed))
        validate(json.loads(res.text), schema)


def test_grammar_unsatisfiable_within_max_tokens(runtime):
    schema = {"type": "object", "required": ["essay"], "properties": {"essay": {"type": "string", "minLength": 400}}}
    res = runtime.generate("Write an essay.", json_schema=schema, max_tokens=12, sampling=GREEDY)
    assert res.finish_reason == "length" and res.text.startswith("{") and res.n_tokens == 12


def test_grammars_that_do_not_parse(runtime):
    with pytest.raises(InvalidRequest, match="grammar does not parse"):
        runtime.submit("Hi", grammar="root ::= (unclosed")
    with pytest.raises(InvalidRequest, match="does not compile: regex parse error.*unclosed group"):
        runtime.submit("Hi", json_schema={"type": "string", "pattern": "^(a$"})


@pytest.mark.parametrize("budget", [0, 1, 16])
def test_budget_closes_the_block_at_n_tokens(runtime, r1_model, budget):
    res = runtime.generate("Why is the sky blue?", model=r1_model, reasoning_budget=budget, max_tokens=24,
                           sampling=GREEDY, confidence=ConfidenceConfig(enabled=False))
    assert res.n_reasoning_tokens == budget and res.reasoning_closed_by == "budget"   # overshoot 0
    assert res.text.strip() and "</think>" not in res.text


def test_budget_with_a_schema_grammar_after_the_block(runtime, r1_model):
    schema = {"type": "object", "required": ["answer"], "properties": {"answer": {"type": "string", "maxLength": 60}}}
    res = runtime.generate("Why is the sky blue?", model=r1_model, reasoning_budget=10, json_schema=schema,
                           max_tokens=80, sampling=GREEDY)
    assert res.n_reasoning_tokens == 10 and res.reasoning
    validate(json.loads(res.text), schema)


def test_budget_leaves_a_batched_neighbour_alone(runtime, r1_model):
    spec = runtime.spec(r1_model, n_parallel=2)
    kw = dict(model=spec, sampling=GREEDY, confidence=ConfidenceConfig(enabled=False))
    alone = runtime.generate("Name three rivers.", max_total_tokens=40, **kw)
    out = {}

    def go(name, prompt, **extra):
        out[name] = runtime.generate(prompt, **kw, **extra)

    ts = [threading.Thread(target=go, args=("budget", "Why is the sky blue?"), kwargs=dict(reasoning_budget=4,
                                                                                            max_tokens=30)),
          threading.Thread(target=go, args=("plain", "Name three rivers."), kwargs=dict(max_total_tokens=40))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert out["plain"].tokens == alone.tokens
    assert out["budget"].n_reasoning_tokens == 4


def test_thinking_off_on_a_qwen3_shaped_template(runtime, tmp_path, default_path):
    path = str(with_chat_template(default_path, tmp_path / "smol-q3.gguf", QWEN3))
    m = runtime.load(path)
    res = runtime.generate("Hi", model=path, thinking="off", max_tokens=8, sampling=GREEDY)
    assert res.reasoning == "" and res.warnings == []
    from comfyui_a3b.runtime import ChatPrompt

    text = m.render_chat(ChatPrompt(({"role": "user", "content": "Hi"},), variables={"enable_thinking": False}))
    assert text.endswith("<think>\n\n</think>\n\n")
    runtime.unload(m.spec)


def test_storyboard_example_gives_panels_that_validate():
    """The example workflow's storyboard node, run as ComfyUI would run it (its API-format inputs)."""
    from pathlib import Path

    from comfyui_a3b.nodes import core, defs

    api = Path(__file__).resolve().parent.parent / "examples" / "api"
    wf = json.loads((api / "storyboard_json.api.json").read_text())
    inputs = {k: v for k, v in wf["3"]["inputs"].items() if not isinstance(v, list)}
    premise = wf["2"]["inputs"]["value"]
    (text, _, reasoning), _ = defs.GENERATE.call("3", **inputs, model=core.load_model(), context=premise)
    validate(json.loads(text), json.loads(inputs["json_schema"]))
