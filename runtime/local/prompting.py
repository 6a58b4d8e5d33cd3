"""What a typed prompt becomes for a model in this process: a chat rendered with the model's template
(or a named one), images as the projector's marker and placeholder ids (imageprompt.py), an infill
prompt built by fim.py, text tokenized. worker.LoadedModel calls these on the caller's thread."""
from __future__ import annotations

from typing import Any

from .. import chat as chatmod
from . import imageprompt
from .. import fim
from ..errors import InvalidRequest, VisionUnavailable
from ..requests import ChatPrompt, InfillPrompt, Prompt, TextPrompt, TokenPrompt, prompt_images


def render_chat(model: Any, prompt: ChatPrompt, messages: list | None = None) -> str:
    """The chat as `model` (a LoadedModel) reads it; images as the projector's marker."""
    v = model.vocab
    if messages is None:   # images as the marker; a text-only chat's text is text, marker or not
        vision = model.vision if prompt_images(prompt) else None
        messages = imageprompt.render_messages(prompt, vision.marker if vision else "")[0]
    return chatmod.render(list(messages), gguf_template=model.info.chat_template, template=prompt.template,
                          bos=v.token_text(v.bos) if v.bos >= 0 else "",
                          eos=v.token_text(v.eos) if v.eos >= 0 else "", tokenizer_adds_bos=v.add_bos,
                          variables=prompt.variables, tools=prompt.tools)


def prompt(model: Any, p: Prompt, max_tokens: int = 0) -> tuple[list[int], str, dict[int, Any]]:
    """(token ids, the rendered chat text or "", the images: {index: unit}) of `p` for `model`; an
    image's tokens are placeholders (imageprompt.py). The caller frees the units."""
    v = model.vocab
    if isinstance(p, TokenPrompt):
        return list(p.tokens), "", {}
    if isinstance(p, TextPrompt):
        return v.tokenize(p.text, add_bos=p.add_bos and v.add_bos, special=p.parse_special), "", {}
    if isinstance(p, ChatPrompt):
        if not prompt_images(p):
            text = render_chat(model, p)
            return v.tokenize(text, add_bos=v.add_bos, special=True), text, {}
        vision = model.vision
        if vision is None:
            raise VisionUnavailable(imageprompt.no_vision_message(model.name))
        messages, parts = imageprompt.render_messages(p, vision.marker)
        text = render_chat(model, p, messages)
        tokens, units = imageprompt.tokens_with_images(vision, text, parts, v.add_bos, model.spec.n_batch)
        return tokens, text, units
    if isinstance(p, InfillPrompt):
        return fim.build(p, v, model.n_ctx_seq, max_tokens), "", {}
    raise InvalidRequest(f"Not a prompt: {type(p).__name__}")
