"""Editor settings: initializationOptions and workspace/didChangeConfiguration, validated.

Clients send settings either flat ({"debounceMs": 40}) or under a section ({"a3b": {...}}); both are
accepted. Unknown keys and bad values are reported back as one clear message each, and the previous
value is kept, so a typo never takes the server down.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..runtime import options as opt
from ..runtime.errors import InvalidRequest
from ..runtime.options import Option, check

SECTION = "a3b"

# The editor's own settings; the ones it shares with the runtime (nCtx, confidenceThreshold) are the
# runtime's declarations.
MODEL = Option("model", str, None, "GGUF path or a name in the model folders; null = the embedded default.",
               nullable=True)
MAX_TOKENS = Option("completion_max_tokens", int, 64, "Most tokens of a multi-line completion.", min=1, max=1024)
MAX_TOKENS_SINGLE_LINE = Option("completion_max_tokens_single_line", int, 32,
                                "Most tokens of a single-line completion.", min=1, max=256)
DEBOUNCE_MS = Option("debounce_ms", int, 40, "Wait this long before running the model; a newer request wins.",
                     min=0, max=5000)
FIM = Option("fim", str, "auto", "Fill-in-the-middle when the model has FIM tokens.", choices=("auto", "on", "off"))
CONTEXT_TOKENS = Option("context_tokens", int, 320, "Prompt tokens from the current file before the cursor.",
                        min=16, max=16384)
SUFFIX_TOKENS = Option("suffix_tokens", int, 48, "Tokens after the cursor given to FIM models.", min=0, max=4096)
CONTEXT_CHUNKS = Option("context_chunks", int, 2, "Chunks of other open files chosen by embedding similarity "
                        "(0 = off).", min=0, max=16)
CHUNK_TOKENS = Option("chunk_tokens", int, 96, "Tokens per chunk from another file.", min=16, max=1024)
MAX_CHUNK_SIMILARITY = Option("max_chunk_similarity", float, 0.99, "Chunks more similar than this to the text at "
                              "the cursor are left out (they make models repeat).", min=0.0, low_open=True, max=1.0)
MAX_DOCUMENT_BYTES = Option("max_document_bytes", int, 32 * 1024 * 1024, "Larger documents are kept in sync but "
                            "not completed or indexed.", min=1024, max=1 << 31)
LORA = Option("lora", str, None, "A GGUF LoRA adapter applied over the model for this editor, from a LoRA folder "
              "(a path or a name in one: loras/ beside the models, $A3B_LORAS, the adapters a3b.tuneWorkspace "
              "wrote); null = none. The plain model stays loaded for "
              "everyone else: the adapter gets a context of its own over the same weights.", nullable=True)
WARM = Option("warm", bool, True, "Read a completion's prompt in the background when the cursor rests.")
#: A quick fix waits for its reasoning: thinking is off unless asked for, and bounded when on.
THINKING = replace(opt.THINKING, default="off")
SPECULATIVE = opt.SPECULATIVE.or_none()
REASONING_BUDGET = replace(opt.REASONING_BUDGET, default=256, help="With thinking on: most reasoning tokens of a "
                           "quick fix or an explanation (null = no limit but the context).")


@dataclass(frozen=True)
class Settings:
    """One connection's settings; each field's meaning, default and bounds: its Option in _KEYS."""

    #: Names that arrive over the protocol are resolved inside the allowed model folders only (see
    #: `Engine.spec_for`).
    model: str | None = MODEL.default
    #: None = the runtime's default (shared with ComfyUI's nodes).
    n_ctx: int | None = None
    #: tensor placement (None = the runtime's default: the planner chooses)
    cpu_moe: bool | None = None
    n_cpu_moe: int | None = None
    override_tensor: str | None = None
    #: where tokens are drawn (None = the runtime's default: llama.cpp's graph where it can)
    backend_sampling: str | None = None
    #: Single-line completions stop at the line's end, and never take more than max_tokens_single_line.
    max_tokens: int = MAX_TOKENS.default
    max_tokens_single_line: int = MAX_TOKENS_SINGLE_LINE.default
    debounce_ms: int = DEBOUNCE_MS.default
    fim: str = FIM.default
    context_tokens: int = CONTEXT_TOKENS.default
    suffix_tokens: int = SUFFIX_TOKENS.default
    context_chunks: int = CONTEXT_CHUNKS.default
    chunk_tokens: int = CHUNK_TOKENS.default
    max_chunk_similarity: float = MAX_CHUNK_SIMILARITY.default
    max_document_bytes: int = MAX_DOCUMENT_BYTES.default
    #: Also when the editor reports the cursor with `a3b/cursor`, so the first completion there is as
    #: fast as later ones.
    warm: bool = WARM.default
    lora: str | None = LORA.default
    lora_scale: float = opt.LORA_SCALE.default
    #: Entropy threshold (nats) for low-confidence spans published as diagnostics.
    confidence_threshold: float = opt.THRESHOLD.default
    #: Thinking models in quick fixes and explanations; inline completions never think: an editor
    #: waits for them.
    thinking: str = THINKING.default
    reasoning_budget: int | None = REASONING_BUDGET.default
    #: Speculative decoding of this editor's requests; None = as the model was loaded (n-gram
    #: lookup unless told otherwise)
    speculative: str | None = SPECULATIVE.default


#: the settings that are load options of the model (LoadSpec fields)
LOAD_FIELDS = ("n_ctx", "cpu_moe", "n_cpu_moe", "override_tensor", "backend_sampling")


#: protocol name -> (field name, the option that declares it)
_KEYS: dict[str, tuple[str, Option]] = {
    "model": ("model", MODEL),
    "modelPath": ("model", MODEL),
    "nCtx": ("n_ctx", opt.N_CTX.or_none()),
    "cpuMoe": ("cpu_moe", opt.CPU_MOE.or_none()),
    "nCpuMoe": ("n_cpu_moe", opt.N_CPU_MOE.or_none()),
    "overrideTensor": ("override_tensor", opt.OVERRIDE_TENSOR),
    "backendSampling": ("backend_sampling", opt.BACKEND_SAMPLING.or_none()),
    "maxTokens": ("max_tokens", MAX_TOKENS),
    "maxTokensSingleLine": ("max_tokens_single_line", MAX_TOKENS_SINGLE_LINE),
    "debounceMs": ("debounce_ms", DEBOUNCE_MS),
    "fim": ("fim", FIM),
    "contextTokens": ("context_tokens", CONTEXT_TOKENS),
    "suffixTokens": ("suffix_tokens", SUFFIX_TOKENS),
    "contextChunks": ("context_chunks", CONTEXT_CHUNKS),
    "chunkTokens": ("chunk_tokens", CHUNK_TOKENS),
    "maxChunkSimilarity": ("max_chunk_similarity", MAX_CHUNK_SIMILARITY),
    "maxDocumentBytes": ("max_document_bytes", MAX_DOCUMENT_BYTES),
    "confidenceThreshold": ("confidence_threshold", opt.THRESHOLD),
    "warm": ("warm", WARM),
    "lora": ("lora", LORA),
    "loraScale": ("lora_scale", opt.LORA_SCALE),
    "thinking": ("thinking", THINKING),
    "reasoningBudget": ("reasoning_budget", REASONING_BUDGET),
    "speculative": ("speculative", SPECULATIVE),
}


def valid(option: Option, value: Any) -> bool:
    """Whether a setting's value is one `option` takes (fim also takes true and false)."""
    if option is FIM and isinstance(value, bool):
        return True
    try:
        check(option, value)
        if option is SPECULATIVE and value is not None:
            opt.parse_speculative(value)
    except InvalidRequest:
        return False
    return True


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
        name, option = spec
        if not valid(option, value):
            errors.append(f"A3B setting {key!r} must be {option.describe(none='null')}; got {value!r}. Keeping "
                          f"{getattr(base, name)!r}.")
            continue
        if name == "fim" and isinstance(value, bool):
            value = "on" if value else "off"
        if name in ("model", "lora") and isinstance(value, str) and not value.strip():
            value = None
        changes[name] = value
    return replace(base, **changes), errors


def lora_path(value: str | None) -> str | None:
    """The adapter setting as a .gguf file inside the LoRA folders (runtime/models/locate.py: `loras/` in the
    model folders, $A3B_LORAS, ComfyUI's loras folders, the tuned adapters' cache folder), as the
    `model` setting is confined to the model folders; InvalidRequest / PathNotAllowed otherwise."""
    if not value:
        return None
    from ..runtime.models.locate import resolve_lora

    return str(resolve_lora(value, "the lora setting"))


def as_dict(s: Settings) -> dict[str, Any]:
    return {f.name: getattr(s, f.name) for f in fields(s)}
