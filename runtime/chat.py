"""Chat prompts: the GGUF's own Jinja template, a named llama.cpp template, or ChatML as fallback
(rendered by llama/templates.py)."""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import InvalidRequest
from .llama.templates import render_jinja, render_named

Message = dict[str, str]


def messages(prompt: str, system: str | None = None, history: list[Message] | None = None) -> list[Message]:
    msgs: list[Message] = []
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.extend(history or [])
    msgs.append({"role": "user", "content": prompt})
    return msgs


def _check(msgs: list[Message]) -> None:
    if not msgs:
        raise InvalidRequest("No chat messages given.")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequest(f"A chat message needs string 'role' and 'content': {m!r}")


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders tools (it reads the `tools` variable)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def render(msgs: list[Message], *, gguf_template: str | None, template: str | None, bos: str, eos: str,
           tokenizer_adds_bos: bool = False, variables: Mapping[str, Any] | None = None,
           tools: Sequence[dict] = ()) -> str:
    """`template`: None/"" = the model's own (GGUF metadata), else a llama.cpp template name.
    `variables` and `tools` go into the model's own template; the named ones take neither."""
    _check(msgs)
    if tools and (template or not supports_tools(gguf_template)):
        raise InvalidRequest("This model's chat template has no tool support (it does not render `tools`), so "
                             "tools cannot be offered to it. Leave tools out, or use a model whose template "
                             "has tools (Qwen3, Hermes, Llama 3.1 and later).")
    if variables and (template or not gguf_template):
        raise InvalidRequest("Chat template variables need the model's own chat template, and "
                             f"{'the named template ' + repr(template) if template else 'this model has none'}. "
                             "Leave the variables out.")
    if template:
        return render_named(template, msgs)
    if gguf_template:
        out = render_jinja(gguf_template, msgs, bos=bos, eos=eos, variables=variables, tools=tools)
        # When the tokenizer adds BOS itself, a template that also writes it would double it.
        if tokenizer_adds_bos and bos and out.startswith(bos):
            out = out[len(bos):]
        return out
    return render_named("chatml", msgs)
