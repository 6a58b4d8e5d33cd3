"""The request types of `a3b serve`'s OpenAI and llama-server endpoints, apart from serving: one
module per endpoint, each reading a JSON body once into a frozen dataclass that the handlers in
serve/app.py take (no handler reads the body itself).

    fields.py       every field the endpoints read, declared once (its wire name, aliases, and the
                    runtime Option giving its bounds and help), NOT_HONOURED, and the field readers
    common.py       Generation (the settings every generating endpoint shares) and structured output
    chat.py         ChatRequest        POST /v1/chat/completions
    completions.py  CompletionRequest  POST /v1/completions
    infill.py       InfillRequest      POST /infill
    embeddings.py   EmbeddingsRequest  POST /v1/embeddings
    tokenize.py     TokenizeRequest    POST /tokenize

A field that does not fit its declaration is a 400 naming it (InvalidRequest), never a value
quietly dropped or clamped. The answer's length is not clamped to the context either: an answer
runs until max_tokens or the context's end, and the result says which (GenerationResult.context_full).
"""
from __future__ import annotations

from .chat import ChatRequest, parse_chat
from .common import Generation, Structured
from .completions import CompletionRequest, parse_completion
from .embeddings import EmbeddingsRequest, parse_embeddings
from .fields import FIELDS, NOT_HONOURED, Field
from .infill import InfillRequest, parse_infill
from .tokenize import TokenizeRequest, parse_tokenize

__all__ = ["ChatRequest", "CompletionRequest", "EmbeddingsRequest", "FIELDS", "Field", "Generation", "InfillRequest",
           "NOT_HONOURED", "Structured", "TokenizeRequest", "parse_chat", "parse_completion", "parse_embeddings",
           "parse_infill", "parse_tokenize"]
