"""A3B Router over the fake engine (fast tier): a handle over two loaded models that A3B Generate routes
per prompt (the route shown in the node), A3B Embed reads through its default model and A3B Unload frees
both; a wrong input is named."""
from __future__ import annotations

import pytest

from comfyui_a3b.nodes import core, defs
from comfyui_a3b.nodes.v1 import NODE_CLASS_MAPPINGS
from comfyui_a3b.runtime.errors import InvalidRequest

CODER = "fake://coder?text=CODE+"
TALKER = "fake://talker?text=PROSE+"
FENCED = "Why does this fail?\n```python\ndef add(a, b):\n    return a + b\n```"


@pytest.fixture()
def routed(fake_engine):
    coder, talker = core.load_model(CODER, n_ctx=512), core.load_model(TALKER, n_ctx=512)
    out = NODE_CLASS_MAPPINGS["A3BRouter"]().run(unique_id="5", default=talker, code=coder)
    yield out["result"][0], coder, talker, out["ui"]
    core.unload()


def _generate(handle, prompt):
    args = {**defs.GENERATE.defaults(), "model": handle, "prompt": prompt, "max_new_tokens": 4, "temperature": 0.0}
    return NODE_CLASS_MAPPINGS["A3BGenerate"]().run(unique_id="6", **args)


def test_each_prompt_goes_to_the_model_its_task_needs(routed):
    handle, coder, talker, ui = routed
    assert "code: " in ui["text"][0]
    out = _generate(handle, FENCED)
    assert out["result"][0].startswith("CODE") and out["ui"]["route"][0].startswith("routed to code (rules")
    out = _generate(handle, "Plan a picnic by the lake.")
    assert out["result"][0].startswith("PROS") and out["ui"]["route"][0].startswith("routed to default")


def test_embed_uses_the_default_model_and_unload_frees_both(routed):
    from comfyui_a3b.runtime import get_runtime

    handle, coder, talker, _ = routed
    emb = NODE_CLASS_MAPPINGS["A3BEmbed"]().run(unique_id="7", model=handle, text="one\ntwo", pooling="mean",
                                                normalize=True)
    assert emb["result"][0].shape[0] == 2
    assert NODE_CLASS_MAPPINGS["A3BUnload"]().run(unique_id="8", model=handle, unload_all=False)["ui"]
    rt = get_runtime()
    assert rt.loaded(coder) is None and rt.loaded(talker) is None


def test_an_input_that_is_not_a_loaded_model_is_named(fake_engine):
    talker = core.load_model(TALKER, n_ctx=512)
    with pytest.raises(InvalidRequest, match="code input must come from an A3B Loader"):
        NODE_CLASS_MAPPINGS["A3BRouter"]().run(unique_id="5", default=talker, code="not a model")
    core.unload()
