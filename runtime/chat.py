"""Chat prompts: the GGUF's own Jinja template, a named llama.cpp template, or ChatML as fallback."""
from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import InvalidRequest

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


def render_jinja(template: str, msgs: list[Message], bos: str, eos: str,
                 variables: Mapping[str, Any] | None = None, tools: Sequence[dict] = ()) -> str:
    """Render a Hugging Face style chat template (sandboxed), via llama-cpp-python's formatter;
    `variables` are the template's own settings (e.g. enable_thinking); `tools` as OpenAI declares them."""
    import jinja2
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    try:
        fmt = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos, add_generation_prompt=True)
        return fmt(messages=msgs, tools=list(tools) or None, **dict(variables or {})).prompt
    except jinja2.TemplateError as e:
        raise InvalidRequest(f"The model's chat template does not work ({type(e).__name__}: {e}). Use one of "
                             "llama.cpp's templates instead (template='chatml'; on the command line "
                             "--template chatml), or fix tokenizer.chat_template in the GGUF.") from e


def render_named(name: str, msgs: list[Message]) -> str:
    """Render with one of llama.cpp's built-in templates ("chatml", "llama3", "gemma", "phi3", ...)."""
    from .llama.binding import llama

    L = llama()
    arr = (L.llama_chat_message * len(msgs))()
    keep: list[Any] = []
    for i, m in enumerate(msgs):
        r, c = m["role"].encode(), m["content"].encode()
        keep += [r, c]
        arr[i].role, arr[i].content = r, c
    size = 4096 + sum(len(m["content"]) for m in msgs) * 2
    buf = ctypes.create_string_buffer(size)
    n = L.llama_chat_apply_template(name.encode(), arr, len(msgs), True, buf, size)
    if n < 0:
        raise InvalidRequest(f"llama.cpp does not know the chat template {name!r}; try 'chatml' or "
                             "leave it empty to use the model's own template.")
    if n > size:
        buf = ctypes.create_string_buffer(n + 1)
        n = L.llama_chat_apply_template(name.encode(), arr, len(msgs), True, buf, n + 1)
    return buf.raw[:n].decode("utf-8", "replace")


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
