"""The language server's thinking settings: inline completions never think; quick fixes and
explanations follow the `thinking` setting, checked like every other setting."""
from __future__ import annotations

import inspect

from comfyui_a3b.lsp_server import config, engine, server


def test_thinking_settings_are_checked():
    s, errors = config.apply(config.Settings(), {"thinking": "on", "reasoningBudget": 64})
    assert (s.thinking, s.reasoning_budget, errors) == ("on", 64, [])
    s2, errors = config.apply(s, {"thinking": "sometimes", "reasoningBudget": -3})
    assert (s2.thinking, s2.reasoning_budget) == ("on", 64) and len(errors) == 2
    assert "thinking" in errors[0] and "reasoningBudget" in errors[1]
    assert config.Settings().thinking == "off"   # quick fixes do not think unless asked


def test_requests_carry_thinking():
    # the chat of quick fixes reads the setting; the inline completion says off
    assert "thinking=s.settings.thinking" in inspect.getsource(server)
    assert 'thinking="off"' in inspect.getsource(engine)
