"""llama-server's `POST /tokenize`: the text (`content`) and whether to add the BOS and read special
tokens (`add_special`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...runtime.errors import InvalidRequest


@dataclass(frozen=True)
class TokenizeRequest:
    model: Any
    content: str
    add_special: bool = False


def parse_tokenize(body: dict) -> TokenizeRequest:
    content = body.get("content")
    if not isinstance(content, str):
        raise InvalidRequest("content must be a string.")
    return TokenizeRequest(body.get("model"), content, bool(body.get("add_special", False)))


__all__ = ["TokenizeRequest", "parse_tokenize"]
