"""Chat prompts rendered by llama.cpp: its built-in named templates, or the GGUF's own Jinja template
through llama-cpp-python's formatter (the policy of which one applies is runtime/chat.py's)."""
from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidRequest
from .binding import llama

Message = dict[str, str]


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
