"""Chat prompts: the GGUF's own Jinja template, a named llama.cpp template, or ChatML as fallback
(rendered by llama/templates.py)."""
from __future__ import annotations

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


def render(msgs: list[Message], *, gguf_template: str | None, template: str | None, bos: str, eos: str,
           tokenizer_adds_bos: bool = False) -> str:
    """`template`: None/"" = the model's own (GGUF metadata), else a llama.cpp template name."""
    _check(msgs)
    if template:
        return render_named(template, msgs)
    if gguf_template:
        out = render_jinja(gguf_template, msgs, bos=bos, eos=eos)
        # When the tokenizer adds BOS itself, a template that also writes it would double it.
        if tokenizer_adds_bos and bos and out.startswith(bos):
            out = out[len(bos):]
        return out
    return render_named("chatml", msgs)
