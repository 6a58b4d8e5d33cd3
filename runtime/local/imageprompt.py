"""A chat prompt with images as the in-process engines feed it: token ids with the images in their place.

The chat is rendered by the model's template with each image written as the projector's marker;
the projector (the backend's `vision`: llama/vision.py, or the fake engine's) splits the text at the
markers, tokenizes the text and prepares each image as a unit of `n_tokens` embeddings taking
`n_pos` positions. In the token list an image holds `n_tokens` placeholder ids made from its content
digest (negative, never a vocabulary id): the scheduler's prefix cache compares token lists, so a
request queued again with the same image reuses the KV cache that image left, and one with another
image does not.
"""
from __future__ import annotations

from typing import Any

from .. import images as imagesmod
from ..errors import InvalidRequest, VisionUnavailable
from ..requests import ChatPrompt, ImagePart, message_text

#: the ids a unit's placeholders are made of: -(digest prefix << UNIT_BITS + index + 1)
UNIT_BITS = 20


def placeholders(digest: str, n: int) -> list[int]:
    base = int(digest[:12], 16) << UNIT_BITS
    return [-(base + i + 1) for i in range(n)]


def no_vision_message(name: str) -> str:
    return (f"{name} has no multimodal projector loaded, so it cannot see images. Put the model's projector "
            "(mmproj-*.gguf) beside the model file, or name it: the loader's mmproj input, --mmproj FILE "
            "on the command line. Or send text only.")


def render_messages(prompt: ChatPrompt, marker: str) -> tuple[list[dict[str, Any]], list[ImagePart]]:
    """The messages with text content (each image as `marker`) and the images in order; user text
    that holds the marker itself is refused (it would stand for an image that is not there)."""
    msgs, parts = [], []
    for i, m in enumerate(prompt.messages):
        content = m["content"]
        if not isinstance(content, str):
            for p in content:
                if isinstance(p, ImagePart):
                    parts.append(p)
                elif marker and marker in p:
                    raise InvalidRequest(f"Message #{i} contains the text {marker!r}, which stands for an image "
                                         "here; remove it from the text.")
        elif marker and marker in content:
            raise InvalidRequest(f"Message #{i} contains the text {marker!r}, which stands for an image here; "
                                 "remove it from the text.")
        msgs.append({**m, "content": message_text(content, marker)})
    return msgs, parts


def tokens_with_images(vision: Any, text: str, parts: list[ImagePart], add_special: bool,
                       n_batch: int) -> tuple[list[int], dict[int, Any]]:
    """(token ids with placeholders, {index: unit}) of rendered `text` holding one marker per image."""
    decoded = [imagesmod.decode(p, f"Image #{i + 1}") for i, p in enumerate(parts)]
    if text.count(vision.marker) != len(decoded):
        raise InvalidRequest(f"The chat template wrote {text.count(vision.marker)} image markers for "
                             f"{len(decoded)} images; it drops or repeats message content.")
    pieces = vision.tokenize(text, decoded, add_special)
    tokens: list[int] = []
    units: dict[int, Any] = {}
    try:
        for piece in pieces:
            if isinstance(piece, int):
                tokens.append(piece)
                continue
            if piece.n_tokens > n_batch and vision.non_causal(piece):
                raise InvalidRequest(f"An image here is {piece.n_tokens} tokens, read in one batch (this projector "
                                     f"attends over the whole image); load the model with n_batch >= "
                                     f"{piece.n_tokens} (now {n_batch}).")
            units[len(tokens)] = piece
            tokens.extend(placeholders(piece.digest, piece.n_tokens))
    except BaseException:
        free_units(pieces)
        raise
    return tokens, units


def free_units(units: Any) -> None:
    for u in (units.values() if isinstance(units, dict) else units):
        u.free()


__all__ = ["VisionUnavailable", "free_units", "no_vision_message", "placeholders", "render_messages",
           "tokens_with_images"]
