"""`POST /v1/embeddings`: the texts to embed (`input`: a string or a non-empty list of strings, at
most MAX_INPUTS; token arrays are not taken) and how the vectors come back (`encoding_format`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...runtime.errors import InvalidRequest

#: Most texts embedded by one request.
MAX_INPUTS = 2048
ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: Any
    input: tuple[str, ...]
    encoding_format: str = "float"


def parse_embeddings(body: dict) -> EmbeddingsRequest:
    """The embeddings request of a JSON body, or InvalidRequest naming the field that does not fit."""
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidRequest("input must be a string or a non-empty list of strings (token arrays are not "
                             "supported).")
    if len(texts) > MAX_INPUTS:
        raise InvalidRequest(f"At most {MAX_INPUTS} texts per request, got {len(texts)}.")
    fmt = body.get("encoding_format", "float")
    if fmt not in ENCODINGS:
        raise InvalidRequest("encoding_format must be 'float' or 'base64'.")
    return EmbeddingsRequest(body.get("model"), tuple(texts), fmt)


__all__ = ["ENCODINGS", "EmbeddingsRequest", "MAX_INPUTS", "parse_embeddings"]
