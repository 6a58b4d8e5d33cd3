"""Editor settings: initializationOptions and workspace/didChangeConfiguration, validated.

Each setting is declared once, in SETTINGS: its Option (default, bounds or choices, help text),
the `Settings` field it sets and the camelCase key editors send (derived from the field's name).
The `Settings` dataclass, the key map and the checks all come from that table.

Clients send settings either flat ({"debounceMs": 40}) or under a section ({"a3b": {...}}); both are
accepted. Unknown keys and bad values are reported back as one clear message each, and the previous
value is kept, so a typo never takes the server down.
"""
from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, fields, make_dataclass, replace
from typing import Any

from ..runtime import options as opt
from ..runtime.errors import InvalidRequest
from ..runtime.options import Option, check

SECTION = "a3b"
#: Keys editors send under the section that are theirs, not the server's settings: the TCP/WS token,
#: and the VS Code extension's executable and server address (editors/vscode/package.json).
CLIENT_KEYS = ("token", "command", "server")

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


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def _blank_is_none(value: Any) -> Any:
    return None if isinstance(value, str) and not value.strip() else value


def _fim(value: Any) -> Any:
    return ("on" if value else "off") if isinstance(value, bool) else value


@dataclass(frozen=True)
class Setting:
    """One editor setting: its Option, the `Settings` field it sets and the key editors send."""

    option: Option
    field: str
    #: the camelCase name in initializationOptions and workspace/didChangeConfiguration
    key: str
    #: other keys taken for it
    aliases: tuple[str, ...] = ()
    #: a load option of the model (a LoadSpec field): a new value loads the model again
    load: bool = False
    #: what a value becomes before it is checked (InvalidRequest: refused)
    parse: Callable[[Any], Any] | None = None

    def accept(self, value: Any) -> Any:
        """`value` as the setting holds it; InvalidRequest when the option does not take it."""
        if self.parse is not None:
            value = self.parse(value)
        check(self.option, value)
        return value


def setting(option: Option, field: str | None = None, **kw: Any) -> Setting:
    """The setting declared by `option`, in the field of its name unless told (the key follows)."""
    field = field or option.name
    return Setting(option, field, _camel(field), **kw)


#: Every editor setting, in the order of `Settings`' fields. Names of models and adapters that arrive
#: over the protocol are resolved inside the allowed folders only (`Engine.spec_for`). None in a
#: runtime setting (nCtx, the placement, backendSampling) means the runtime's default, shared with
#: ComfyUI's nodes. Inline completions never think (an editor waits for them); `thinking` is for
#: quick fixes and explanations.
SETTINGS: tuple[Setting, ...] = (
    setting(MODEL, aliases=("modelPath",), parse=_blank_is_none),
    setting(opt.N_CTX.or_none(), load=True),
    setting(opt.CPU_MOE.or_none(), load=True),
    setting(opt.N_CPU_MOE.or_none(), load=True),
    setting(opt.OVERRIDE_TENSOR, load=True),
    setting(opt.BACKEND_SAMPLING.or_none(), load=True),
    setting(MAX_TOKENS, "max_tokens"),
    setting(MAX_TOKENS_SINGLE_LINE, "max_tokens_single_line"),
    setting(DEBOUNCE_MS),
    setting(FIM, parse=_fim),
    setting(CONTEXT_TOKENS),
    setting(SUFFIX_TOKENS),
    setting(CONTEXT_CHUNKS),
    setting(CHUNK_TOKENS),
    setting(MAX_CHUNK_SIMILARITY),
    setting(MAX_DOCUMENT_BYTES),
    setting(WARM),
    setting(LORA, parse=_blank_is_none),
    setting(opt.LORA_SCALE),
    setting(opt.THRESHOLD, "confidence_threshold"),
    setting(THINKING),
    setting(REASONING_BUDGET),
    setting(SPECULATIVE),
)

Settings = make_dataclass(
    "Settings",
    [(s.field, s.option.type | None if s.option.nullable else s.option.type,
      dataclasses.field(default=s.option.default)) for s in SETTINGS],
    frozen=True)
Settings.__module__ = __name__
Settings.__doc__ = "One connection's settings: a field per entry of SETTINGS, its default the option's."

#: the settings that are load options of the model (LoadSpec fields)
LOAD_FIELDS = tuple(s.field for s in SETTINGS if s.load)

#: key editors send -> the setting
BY_KEY: dict[str, Setting] = {k: s for s in SETTINGS for k in (s.key, *s.aliases)}
#: key -> (field name, the option that declares it)
_KEYS: dict[str, tuple[str, Option]] = {k: (s.field, s.option) for k, s in BY_KEY.items()}


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
        s = BY_KEY.get(key)
        if s is None:
            if key not in CLIENT_KEYS:
                errors.append(f"Unknown A3B setting {key!r} (known: {', '.join(sorted(BY_KEY))}).")
            continue
        try:
            changes[s.field] = s.accept(value)
        except InvalidRequest:
            errors.append(f"A3B setting {key!r} must be {s.option.describe(none='null')}; got {value!r}. Keeping "
                          f"{getattr(base, s.field)!r}.")
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
