"""A3BGenerate with a thinking model (the fake engine): the reasoning output, streamed reasoning
events for the web extension, the thinking choice, the budget and the json_schema input."""
from __future__ import annotations

import pytest

from comfyui_a3b.nodes import comfy, core, defs, generation

THINK = "fake://node-think?template=qwen3&think=Panel+one+first.&text=It+is+4.&eos_after=43"
LOOP = "fake://node-loop?template=qwen3&think=Hmm.&think_loop=1&text=[1]"


@pytest.fixture
def spec(fake_engine):
    from comfyui_a3b.runtime import get_runtime

    yield lambda ref: core.load_model(ref)
    get_runtime().unload()


def run(spec, ref, **inputs):
    args = {**defs.GENERATE.defaults(), "model": spec(ref), "prompt": "What is 2 + 2?", "temperature": 0.0, **inputs}
    return defs.GENERATE.call("7", **args)


def test_reasoning_is_its_own_output(spec, monkeypatch):
    sent = []
    monkeypatch.setattr(comfy, "send", lambda event, data: sent.append((event, data)))
    (text, spans, reasoning), ui = run(spec, THINK)
    assert (text, reasoning) == ("It is 4.", "Panel one first.")
    streamed = "".join(d.get("reasoning", "") for e, d in sent if e == comfy.EVENT_TOKEN)
    assert streamed == reasoning and "".join(d.get("text", "") for e, d in sent if e == comfy.EVENT_TOKEN) == text
    done = [d for e, d in sent if e == comfy.EVENT_DONE][-1]
    assert done["n_reasoning_tokens"] > 0


def test_thinking_off_and_budget_inputs(spec):
    (text, _, reasoning), _ = run(spec, THINK, thinking="off", max_new_tokens=8)
    assert (text, reasoning) == ("It is 4.", "")
    g = generation.generate(spec(LOOP), "Storyboard?", max_new_tokens=3, reasoning_budget=2,
                      sampling=generation.sampling_params(temperature=0.0))
    assert (g.text, g.result.n_reasoning_tokens, g.result.reasoning_closed_by) == ("[1]", 2, "budget")
    (text, _, reasoning), _ = run(spec, LOOP, reasoning_budget=2, max_new_tokens=3)
    assert (text, reasoning) == ("[1]", "H")   # two tokens: the newline after <think>, then "H"


def test_json_schema_input(spec):
    (text, _, _), _ = run(spec, LOOP, json_schema='{"type": "array"}', reasoning_budget=1, max_new_tokens=3)
    assert text == "[1]"
    from comfyui_a3b.runtime import get_runtime

    assert get_runtime().load(spec(LOOP)).backend.grammar_starts[-1].endswith("</think>\n\n")


@pytest.mark.parametrize("schema,match", [("{not json", "not JSON"), ("[1, 2]", "JSON object"),
                                          ('{"type": "nonsense"}', "does not compile")])
def test_bad_json_schema_input(spec, schema, match):
    with pytest.raises(Exception, match=match):
        run(spec, THINK, json_schema=schema)


def test_old_workflows_without_the_new_inputs_still_run(spec):
    """A workflow saved before these inputs existed leaves them out: their defaults apply."""
    args = {k: v for k, v in defs.GENERATE.defaults().items() if k not in ("thinking", "reasoning_budget",
                                                                           "json_schema")}
    (text, _, reasoning), _ = defs.GENERATE.call("8", **{**args, "model": spec(THINK), "prompt": "Hi",
                                                         "temperature": 0.0})
    assert text == "It is 4." and reasoning


def test_a_reasoning_without_a_budget_leaves_room_for_the_answer(spec):
    """No budget set (the widget's -1): the reasoning gets what the context holds beyond the prompt and
    max_new_tokens, so a model that would reason forever is closed in time and still answers."""
    handle = core.load_model(LOOP, n_ctx=256)
    (text, _, reasoning), ui = run(lambda ref: handle, LOOP, max_new_tokens=8)
    assert text.startswith("[1]") and reasoning and "note" not in ui
    n_prompt = __import__("comfyui_a3b.runtime", fromlist=["get_runtime"]).get_runtime().count_tokens(
        __import__("comfyui_a3b.runtime", fromlist=["ChatPrompt"]).ChatPrompt(
            [{"role": "user", "content": "What is 2 + 2?"}]), model=handle)
    assert generation.room_for_reasoning(256, n_prompt, 8) == 256 - n_prompt - 8 - generation.CLOSE_RESERVE


def test_a_reasoning_that_takes_every_token_says_so_in_the_node_and_its_result(spec, monkeypatch):
    sent = []
    monkeypatch.setattr(comfy, "send", lambda event, data: sent.append((event, data)))
    # a budget larger than the context holds: the reasoning fills the context, no answer comes
    handle = core.load_model(LOOP, n_ctx=256)
    (text, _, reasoning), ui = run(lambda ref: handle, LOOP, max_new_tokens=8, reasoning_budget=4000)
    assert text == "" and reasoning
    note = ui["note"][0]
    assert note.startswith("The reasoning used all ") and "raise max_new_tokens" in note
    assert "reasoning_budget" in note
    done = [d for e, d in sent if e == comfy.EVENT_DONE][-1]
    assert done["note"] == note
