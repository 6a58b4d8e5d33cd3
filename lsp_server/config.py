"""Editor settings: initializationOptions and workspace/didChangeConfiguration, validated.

Clients send settings either flat ({"debounceMs": 40}) or under a section ({"a3b": {...}}); both are
accepted. Unknown keys and bad values are reported back as one clear message each, and the previous
value is kept, so a typo never takes the server down.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from ..runtime.generation import ConfidenceConfig
from ..runtime.options import REASONING_BUDGET, THINKING

SECTION = "a3b"


@dataclass(frozen=True)
class Settings:
    #: GGUF path or a name in the model folders; None = the embedded default. Names that arrive over
    #: the protocol are resolved inside the allowed model folders only (see `Engine.spec_for`).
    model: str | None = None
    #: Context tokens per sequence slot; None = the runtime's default (shared with ComfyUI's nodes).
    n_ctx: int | None = None
    #: Most tokens of a multi-line completion (single-line completions stop at the line's end).
    max_tokens: int = 64
    #: Single-line completions never take more than this.
    max_tokens_single_line: int = 32
    #: Wait this long after a request before running the model; a newer request in the meantime wins.
    debounce_ms: int = 40
    #: Fill-in-the-middle when the model has FIM tokens: "auto" (use them if present), "on", "off".
    fim: str = "auto"
    #: Prompt budget for the current file (tokens before the cursor).
    context_tokens: int = 320
    #: Tokens after the cursor given to FIM models.
    suffix_tokens: int = 48
    #: Chunks from other open files, chosen by embedding similarity (0 = off).
    context_chunks: int = 2
    #: Tokens per chunk from another file.
    chunk_tokens: int = 96
    #: Chunks more similar than this to the text at the cursor are left out (they make models repeat).
    max_chunk_similarity: float = 0.99
    #: Documents larger than this are kept in sync but not completed or indexed.
    max_document_bytes: int = 32 * 1024 * 1024
    #: Read a completion's prompt in the background when the user pauses at an edit (or the editor
    #: reports the cursor with `a3b/cursor`), so the first completion there is as fast as later ones.
    warm: bool = True
    #: Entropy threshold (nats) for low-confidence spans published as diagnostics.
    confidence_threshold: float = ConfidenceConfig.threshold
    #: Thinking models in quick fixes and explanations (THINKING's choices); inline completions
    #: never think: an editor waits for them.
    thinking: str = "off"
    #: With thinking on: most reasoning tokens of a quick fix (None: no limit but the context).
    reasoning_budget: int | None = 256


# protocol name -> (field name, type check, description of the valid values)
_KEYS: dict[str, tuple[str, Any, str]] = {
    "model": ("model", lambda v: v is None or isinstance(v, str), "a model path or name, or null"),
    "modelPath": ("model", lambda v: v is None or isinstance(v, str), "a model path or name, or null"),
    "nCtx": ("n_ctx", lambda v: v is None or (_int(v) and 256 <= v <= 131072), "an integer in 256..131072, or null"),
    "maxTokens": ("max_tokens", lambda v: _int(v) and 1 <= v <= 1024, "an integer in 1..1024"),
    "maxTokensSingleLine": ("max_tokens_single_line", lambda v: _int(v) and 1 <= v <= 256, "an integer in 1..256"),
    "debounceMs": ("debounce_ms", lambda v: _int(v) and 0 <= v <= 5000, "an integer in 0..5000"),
    "fim": ("fim", lambda v: v in ("auto", "on", "off", True, False), '"auto", "on" or "off"'),
    "contextTokens": ("context_tokens", lambda v: _int(v) and 16 <= v <= 16384, "an integer in 16..16384"),
    "suffixTokens": ("suffix_tokens", lambda v: _int(v) and 0 <= v <= 4096, "an integer in 0..4096"),
    "contextChunks": ("context_chunks", lambda v: _int(v) and 0 <= v <= 16, "an integer in 0..16"),
    "chunkTokens": ("chunk_tokens", lambda v: _int(v) and 16 <= v <= 1024, "an integer in 16..1024"),
    "maxChunkSimilarity": ("max_chunk_similarity", lambda v: _num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "maxDocumentBytes": ("max_document_bytes", lambda v: _int(v) and 1024 <= v <= 1 << 31, "an integer >= 1024"),
    "confidenceThreshold": ("confidence_threshold", lambda v: _num(v) and v > 0, "a number > 0"),
    "warm": ("warm", lambda v: isinstance(v, bool), "true or false"),
    "thinking": ("thinking", lambda v: v in THINKING.choices, " or ".join(f'"{c}"' for c in THINKING.choices)),
    "reasoningBudget": ("reasoning_budget", lambda v: v is None or (_int(v) and REASONING_BUDGET.lo <= v
                                                                    <= REASONING_BUDGET.hi),
                        f"an integer in {REASONING_BUDGET.lo}..{REASONING_BUDGET.hi}, or null"),
}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def apply(base: Settings, raw: Any) -> tuple[Settings, list[str]]:
    """New settings from `raw` over `base`, and one message per rejected entry."""
    if raw is None:
        return base, []
    if not isinstance(raw, dict):
        return base, [f"A3B settings must be an object, got {type(raw).__name__}; settings unchanged."]
    if isinstance(raw.get(SECTION), dict):
        raw = raw[SECTION]
    changes: dict[str, Any] = {}
    errors: list[str] = []
    for key, value in raw.items():
        spec = _KEYS.get(key)
        if spec is None:
            if key not in ("token",):  # the TCP/WS token travels here too; not a setting
                errors.append(f"Unknown A3B setting {key!r} (known: {', '.join(sorted(_KEYS))}).")
            continue
        name, ok, desc = spec
        if not ok(value):
            errors.append(f"A3B setting {key!r} must be {desc}; got {value!r}. Keeping "
                          f"{getattr(base, name)!r}.")
            continue
        if name == "fim" and isinstance(value, bool):
            value = "on" if value else "off"
        if name == "model" and isinstance(value, str) and not value.strip():
            value = None
        changes[name] = value
    return replace(base, **changes), errors


def as_dict(s: Settings) -> dict[str, Any]:
    return {f.name: getattr(s, f.name) for f in fields(s)}
