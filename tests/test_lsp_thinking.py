"""The language server's thinking settings: inline completions never think; quick fixes and
explanations follow the `thinking` setting, checked like every other setting."""
from __future__ import annotations

import inspect

from comfyui_a3b.lsp_server import completion, config
from comfyui_a3b.lsp_server.actions import ModelActions


def test_thinking_settings_are_checked():
    s, errors = config.apply(config.Settings(), {"thinking": "on", "reasoningBudget": 64})
    assert (s.thinking, s.reasoning_budget, errors) == ("on", 64, [])
    s2, errors = config.apply(s, {"thinking": "sometimes", "reasoningBudget": -3})
    assert (s2.thinking, s2.reasoning_budget) == ("on", 64) and len(errors) == 2
    assert "thinking" in errors[0] and "reasoningBudget" in errors[1]
    assert config.Settings().thinking == "off"   # quick fixes do not think unless asked


def test_quick_fix_chat_follows_the_thinking_setting(fake_engine):
    """The chat behind quick fixes and explanations, over a fake thinking model: off by default (the
    answer alone, no reasoning), on with the setting and then bounded by reasoningBudget."""
    import asyncio
    from types import SimpleNamespace

    from comfyui_a3b.runtime import get_runtime

    rt = get_runtime()
    spec = rt.spec("fake://lsp-think?template=qwen3&think=Hmm.&think_loop=1&text=fixed()")

    async def model(progress=None):
        return rt.load(spec)

    def chat(settings):
        session = SimpleNamespace(model=model, engine=SimpleNamespace(rt=rt, executor=None), spec=lambda: spec,
                                  settings=settings)
        return asyncio.run(ModelActions(session).chat([{"role": "user", "content": "Fix it."}], 7))

    try:
        off = chat(config.Settings())
        assert (off.text, off.reasoning) == ("fixed()", "")
        on = chat(config.Settings(thinking="on", reasoning_budget=5))
        assert on.text == "fixed()" and on.n_reasoning_tokens == 5
    finally:
        rt.unload(spec)


def test_inline_completions_never_think(fake_engine):
    # a text or infill prompt has no template to switch: "off" is said explicitly and costs nothing
    assert 'thinking="off"' in inspect.getsource(completion.Completer._start)
