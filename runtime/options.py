"""Every option a caller can choose, declared once: name, type, default, bounds or choices, help
text and environment variable, in one `Option` each.

The runtime's own types take their defaults and checks from these declarations (`LoadSpec` below,
SamplingParams and ConfidenceConfig in generation.py, GenerationRequest in requests.py), and every
surface reads the same ones: the CLI's flags (`add_argument`), the ComfyUI node widgets (nodes/defs.py
maps an Option to an INT/FLOAT/COMBO input), the language-server settings (lsp_server/config.py) and
`a3b serve`'s request parsing (`check`). A surface that deliberately means something else (the
language server's own completion length, a widget that cannot hold None) declares its own Option
instead of writing a second default. The lists of choices below are the only ones in the project.
A spec is checked by `validate()` before any weights load, so a typo in a KV cache type fails in
microseconds with a message instead of inside llama.cpp. Environment variables are declared in
environment.py.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .environment import env
from .errors import InvalidRequest

#: Embedding pooling over a text's tokens (llama.cpp's own pooling types).
POOLINGS = ("mean", "cls", "last")
#: llama.cpp's flash-attention setting.
FLASH_ATTN_MODES = ("auto", "on", "off")
#: KV cache element types llama.cpp takes for K and V (quantised V needs flash attention).
KV_CACHE_TYPES = ("f16", "q8_0", "q4_0", "f32", "bf16", "q5_0", "q5_1", "q4_1")
#: What to do when n_ctx exceeds the model's trained context.
CTX_POLICIES = ("warn", "refuse")
#: The llama.cpp types a model can be re-encoded into for serving (llama/reencode.py).
SERVE_FORMATS = ("q8_0", "f16", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q6_k")
#: How a model is served: the file as is, the faster of it and a re-encoded copy, or a copy.
SERVE_AS = ("as-is", "auto", *SERVE_FORMATS)
#: Whether a thinking model reasons before its answer.
THINKING_MODES = ("auto", "on", "off")


def cache_root() -> Path:
    """Where re-encoded copies and pruned variants are cached: $A3B_CACHE, else the user's cache
    folder ($XDG_CACHE_HOME or ~/.cache) / comfyui-a3b. Created on first use by the callers."""
    import os

    base = env("A3B_CACHE")
    if base:
        return Path(base).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "comfyui-a3b"


def check_finite(name: str, value: Any) -> float:
    """`value` as a float, or InvalidRequest when it is not a number, NaN or infinite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
    return v


@dataclass(frozen=True)
class Option:
    """One setting: what every surface shows and checks for it."""

    name: str
    type: type                      # int, float, str, bool, dict (a JSON object) or tuple (of choices)
    default: Any
    #: one or two sentences; node tooltips show it as written, the CLI's help in its own style
    help: str
    min: float | None = None
    max: float | None = None
    #: the bound itself is outside the range: top_p's (0, 1] is min=0, low_open=True
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | None = None
    #: words taken besides the numbers (n_gpu_layers' "auto"); None taken too where nullable
    words: tuple[str, ...] = ()
    nullable: bool = False
    #: how far a node widget's arrows move it; an open bound's widget stops one step inside it
    step: float | None = None
    #: the environment variable that gives its default, where there is one (environment.py)
    env: str | None = None
    #: what error messages call it where the field's name is not the words ("keep ratio")
    label: str | None = None
    #: said after a bad value, where the help alone would not tell what to choose
    hint: str | None = None

    def range_text(self) -> str:
        """The bounds in words: `in 1..64`, `>= 0`, `in (0, 1]`."""
        lo, hi = self.min, self.max
        if self.type is int:
            if lo is not None and hi is not None:
                return f"in {lo}..{hi}"
            return f">= {lo}" if lo is not None else f"<= {hi}"
        if lo is not None and hi is not None:
            return f"in {'(' if self.low_open else '['}{lo:g}, {hi:g}{')' if self.high_open else ']'}"
        if lo is not None:
            return f"{'>' if self.low_open else '>='} {lo:g}"
        return f"{'<' if self.high_open else '<='} {hi:g}"

    def describe(self, none: str = "None") -> str:
        """The valid values in words, e.g. `an integer in 1..64, or null` (with none="null")."""
        if self.choices is not None:
            text = "one of " + ", ".join(self.choices)
        elif self.type is bool:
            text = "true or false"
        elif self.type is str:
            text = "text"
        elif self.type is dict:
            text = "a JSON object"
        else:
            text = ("an integer" if self.type is int else "a number") + (
                "" if self.min is None and self.max is None else " " + self.range_text())
        words = [repr(w) for w in self.words] + ([none] if self.nullable else [])
        return text + "".join(f", or {w}" for w in words)

    def within(self, value: float) -> bool:
        lo, hi = self.min, self.max
        return ((lo is None or (value > lo if self.low_open else value >= lo))
                and (hi is None or (value < hi if self.high_open else value <= hi)))

    def widget_bounds(self) -> tuple[float | None, float | None]:
        """The smallest and largest value a node widget offers: the bounds, an open one a step inside."""
        lo = None if self.min is None else round(self.min + (self.step if self.low_open else 0), 10)
        hi = None if self.max is None else round(self.max - (self.step if self.high_open else 0), 10)
        return lo, hi

    def or_none(self) -> Option:
        """The same option where None (the runtime's default) may be given: a setting that leaves it open."""
        return replace(self, default=None, nullable=True)


def check(option: Option, value: Any, name: str | None = None, error: type[Exception] = InvalidRequest) -> Any:
    """`value` if `option` takes it, else `error` (InvalidRequest) saying what is taken, under
    `name` (default: the option's label or name)."""
    name = name or option.label or option.name
    if value is None and option.nullable:
        return value
    if option.type is tuple:   # names from `choices`, in an order, each at most once
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise error(f"{name} must be a list of names ({', '.join(option.choices or ())}), got {value!r}")
        bad = [v for v in value if v not in (option.choices or ())]
        if bad or len(set(value)) < len(value):
            what = f"{bad[0]!r} is not supported" if bad else "a name is given twice"
            raise error(f"{name}: {what}; give each at most once, from {', '.join(option.choices or ())}")
        return tuple(value)
    if isinstance(value, str) and value in option.words:
        return value
    if option.choices is not None:
        if value not in option.choices:
            raise error(f"{name} must be one of {', '.join(option.choices)}; got {value!r}")
        return value
    kind = option.type
    if kind in (bool, str, dict):
        if not isinstance(value, kind):
            raise error(f"{name} must be {option.describe()}, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        what = "an integer" if kind is int else "a number"
        raise error(f"{name} must be {what}{' or ' + ', '.join(map(repr, option.words)) if option.words else ''}, "
                    f"got {value!r}")
    if kind is float and not math.isfinite(value) and (option.min is None or option.max is None):
        raise error(f"{name} must be a finite number, got {value!r}")
    if not option.within(value):   # NaN is within no bounds, infinity not within two
        hint = f": {option.hint}" if option.hint else ""
        raise error(f"{name} must be {option.range_text()}, got {value!r}{hint}")
    return value


def cli_help(text: str) -> str:
    """An option's help as argparse shows it: lower case at the start (unless a capital word such as
    CPU starts it), no final full stop."""
    text = text.rstrip(".")
    return text[0].lower() + text[1:] if len(text) > 1 and text[1].islower() else text


def add_argument(parser, option: Option, *flags: str, default_text: str | None = None, **kwargs: Any):
    """Add `option` to an argparse parser: `flags` (default `--name-with-dashes`), its type or
    choices, its default and its help. A command that means something else by leaving it out (a
    preset's value) passes `default=` and says what in `default_text`."""
    kw: dict[str, Any] = {"default": option.default, "help": cli_help(option.help)}
    if default_text:
        kw["help"] += f" (default: {default_text})"
    if option.choices is not None:
        kw["choices"] = option.choices
    elif option.type is dict:   # a JSON object: the command line names a file holding it, which the command reads
        kw.update(type=str, metavar="FILE")
    elif option.type is not bool:
        kw["type"] = _parse_words(option) if option.words else option.type
    kw.update(kwargs)
    action = parser.add_argument(*(flags or ("--" + option.name.replace("_", "-"),)), **kw)
    action.option = option   # what the tests compare the flag with
    return action


def _parse_words(option: Option):
    def parse(text: str):
        import argparse

        if text.strip().lower() in option.words:
            return text.strip().lower()
        try:
            return option.type(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {option.describe()}, got {text!r}") from None
    return parse


#: Longest context (tokens per slot) taken: 2**20 holds the longest trained contexts of current models
#: (256K and 1M-token releases), and a KV cache that does not fit is refused by the memory check before
#: llama.cpp allocates it; llama.cpp takes the count as a 32-bit value.
MAX_CONTEXT = 1 << 20

# -- load options (LoadSpec) -----------------------------------------------------------------------------
N_CTX = Option("n_ctx", int, 2048, "Context tokens per request: prompt and answer together.",
               min=16, max=MAX_CONTEXT, step=256)
N_PARALLEL = Option("n_parallel", int, 2, "Sequence slots: requests decoded together.", min=1, max=64)
N_GPU_LAYERS = Option("n_gpu_layers", int, "auto",
                      "Layers offloaded to a GPU: auto = the planner fits layers, expert tensors and context into "
                      "the free GPU memory (0 without a GPU), 0 = CPU only, -1 = all, N = the last N layers.",
                      # any count beyond the model's layers means all of them; llama.cpp takes an int32
                      min=-1, max=2**31 - 1, words=("auto",))
N_THREADS = Option("n_threads", int, 0,
                   "CPU threads; 0 = automatic (half the cores for decoding, all for prompts).",
                   min=0, max=512)   # ggml's GGML_MAX_N_THREADS
N_BATCH = Option("n_batch", int, 256, "Tokens per decode step; prompts are read in chunks of this size.",
                 min=1, max=MAX_CONTEXT)
FLASH_ATTN = Option("flash_attn", str, "auto", "llama.cpp's flash attention.", choices=FLASH_ATTN_MODES)
KV_CACHE_TYPE = Option("kv_cache_type", str, "f16", "KV cache precision; q8_0 halves its memory.",
                       choices=KV_CACHE_TYPES)
USE_MMAP = Option("use_mmap", bool, True, "Map the model file instead of reading it into memory.")
LORA_PATH = Option("lora_path", str, None, "A GGUF LoRA adapter applied over the model.", nullable=True)
LORA_SCALE = Option("lora_scale", float, 1.0, "How strongly the LoRA adapter applies; 1 = as trained.",
                    min=-4.0, max=4.0, step=0.05)
SERVE_AS_OPTION = Option("serve_as", str, "as-is",
                         "Serve the file as is, a copy re-encoded once (q8_0 reads prompts about twice as fast "
                         "for small Q4 models), or whichever measures faster here (auto).", choices=SERVE_AS)
EMBED_N_CTX = Option("embed_n_ctx", int, 256,
                     "Longest text the embedding context takes, in tokens (longer texts are refused).",
                     min=8, max=1 << 16)
MMPROJ = Option("mmproj", str, "auto",
                "The multimodal projector (mmproj GGUF) that lets the model see images: auto = the mmproj*.gguf "
                "beside the model file, a path, or off.")
CPU_MOE = Option("cpu_moe", bool, False,
                 "Keep every expert tensor of a mixture-of-experts model in system RAM, computed on the CPU; "
                 "attention, shared experts and the KV cache stay on the GPU.")
N_CPU_MOE = Option("n_cpu_moe", int, 0,
                   "Keep the expert tensors of the first N layers in system RAM (0 = none; auto GPU layers "
                   "choose it from the free GPU memory when no placement is given).",
                   min=0, max=512)   # llama.cpp's LLAMA_MAX_LAYERS
OVERRIDE_TENSOR = Option("override_tensor", str, None,
                         "Tensor placement like llama.cpp's -ot: REGEX=DEVICE, comma-separated; DEVICE is CPU or "
                         "a GPU name a3b doctor lists (CUDA0).", nullable=True)
CTX_POLICY = Option("ctx_policy", str, "warn",
                    "When the context asked for exceeds the model's trained context: load and log a warning "
                    "(warn), or stop with an error (refuse).", choices=CTX_POLICIES)

#: The speculative modes: no drafts; n-gram lookup in the request's prompt and output; a draft
#: model (`draft:MODEL`); the model's own multi-token-prediction layers; auto (n-gram lookup).
SPECULATIVE_MODES = ("off", "ngram", "draft", "mtp", "auto")


def parse_speculative(value: str | None) -> tuple[str, str | None]:
    """("off" | "ngram" | "draft" | "mtp" | "auto", the draft model or None) of a `speculative`
    setting; InvalidRequest naming what is taken otherwise."""
    if value is None:
        return "auto", None
    if not isinstance(value, str):
        raise InvalidRequest(f"speculative must be text (off, ngram, draft:MODEL, mtp, auto), got {value!r}")
    head, sep, model = value.strip().partition(":")
    head = head.lower()
    if head == "draft":
        if not sep or not model.strip():
            raise InvalidRequest("speculative=draft needs a model: draft:MODEL (a GGUF path or name with the "
                                 "same vocabulary).")
        return "draft", model.strip()
    if sep or head not in SPECULATIVE_MODES:
        raise InvalidRequest(f"speculative must be one of off, ngram, draft:MODEL, mtp, auto; got {value!r}")
    return head, None


def state_snapshots(speculative: str | None, draft_max: int) -> int:
    """Recurrent-state snapshots a sequence keeps (llama.cpp's n_rs_seq) under a `speculative`
    setting: draft_max when speculation is asked for by name, so that rejected drafts can be undone
    in a recurrent layer; none for off and auto (auto does not speculate on such a model). Models
    without recurrent layers ignore it."""
    return draft_max if parse_speculative(speculative)[0] not in ("off", "auto") else 0


SPECULATIVE = Option("speculative", str, "auto",
                     "Speculative decoding: off; ngram (drafts looked up in the prompt and the answer so far); "
                     "draft:MODEL (a smaller model with the same vocabulary drafts); mtp (the model's own "
                     "multi-token-prediction layers); auto (ngram, except on models with recurrent layers). "
                     "Greedy output is the same either way.")
DRAFT_MAX = Option("draft_max", int, 8, "Most tokens drafted per request and step (speculative decoding).",
                   min=1, max=64)

#: Sampling inside llama.cpp's graph (on the GPU where the model runs there): auto, on or off.
BACKEND_SAMPLING_MODES = ("auto", "on", "off")
BACKEND_SAMPLING = Option("backend_sampling", str, "auto",
                          "Draw tokens inside llama.cpp's compute graph (on the GPU when the model is there): requests "
                          "with confidence spans, their entropy measured there (auto); also greedy requests and "
                          "temperature chains, which the CPU drew faster (on); never (off). A repeat penalty, a "
                          "grammar or logprobs keep the CPU sampler.", choices=BACKEND_SAMPLING_MODES)

# -- sampling (SamplingParams) ------------------------------------------------------------------------------
TEMPERATURE = Option("temperature", float, 0.4, "Sampling temperature; 0 = always the likeliest token.",
                     min=0.0, max=2.0, step=0.05)   # OpenAI's range
TOP_P = Option("top_p", float, 0.95,
               "Nucleus sampling: the smallest set of tokens whose probabilities sum to top_p.",
               min=0.0, low_open=True, max=1.0, step=0.01)
TOP_K = Option("top_k", int, 40, "Sample among the top_k likeliest tokens; 0 = off.",
               min=0, max=1 << 20)   # beyond the vocabulary it means all of it
MIN_P = Option("min_p", float, 0.05, "Drop tokens below min_p times the likeliest token's probability.",
               min=0.0, max=1.0, high_open=True, step=0.01)
REPEAT_PENALTY = Option("repeat_penalty", float, 1.1, "Penalty on recently seen tokens; 1 = off.",
                        min=0.0, low_open=True, max=2.0, step=0.01)
REPEAT_LAST_N = Option("repeat_last_n", int, 64, "Recent tokens the repeat penalty looks at; 0 = none.",
                       min=0, max=MAX_CONTEXT)
#: the samplers a request may order, and their order when it gives none (llama-server's names)
SAMPLER_NAMES = ("top_k", "penalties", "top_p", "min_p", "temperature", "infill")
SAMPLERS = Option("samplers", tuple, None,
                  "The order in which the samplers apply, as llama-server's field names them (top_k, penalties, "
                  "top_p, min_p, temperature, infill); one left out does not apply. Default: top_k, penalties, "
                  "top_p, min_p, temperature.", choices=SAMPLER_NAMES, nullable=True)
IGNORE_EOS = Option("ignore_eos", bool, False,
                    "Never end at the model's end-of-generation token: generate up to max_tokens (or a stop "
                    "string); llama-server's and vLLM's field of the same name.")
SEED = Option("seed", int, None, "Sampler seed: the same seed and settings give the same text.",
              min=0, max=2**32 - 1, nullable=True)   # None: a fresh seed per request, recorded in the result


def wrap_seed(value: Any) -> Any:
    """An integer seed brought into llama.cpp's 32 bits (ComfyUI's seed widget and OpenAI clients send
    up to 64); anything else as it is, for the check to name."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value % (SEED.max + 1)
    return value


# -- confidence (ConfidenceConfig) and the request (GenerationRequest) -------------------------------------
THRESHOLD = Option("threshold", float, 2.1,
                   "Entropy (nats) of the next-token distribution above which a token is low-confidence.",
                   # no distribution over 2**20 tokens or fewer has an entropy above ln(2**20) = 13.9 nats
                   min=0.0, low_open=True, max=16.0, step=0.1, label="confidence threshold")
MIN_RUN = Option("min_run", int, 5, "Consecutive low-confidence tokens that make a low-confidence span.",
                 min=1, max=MAX_CONTEXT)
MAX_TOKENS = Option("max_tokens", int, 512, "Most tokens to generate.", min=1, max=MAX_CONTEXT)
LOGPROBS = Option("logprobs", int, None,
                  "Log-probabilities reported with every token: the sampled token's and this many likeliest "
                  "alternatives'.", min=0, max=20, nullable=True)   # OpenAI's top_logprobs range

# -- thinking models and structured output (GenerationRequest) ---------------------------------------------
THINKING = Option("thinking", str, "auto",
                  "Reasoning before the answer (thinking models): auto = as the model's template does unasked, on, "
                  "or off (off where the template has a switch; otherwise the block is closed as soon as it opens).",
                  choices=THINKING_MODES)
REASONING_BUDGET = Option("reasoning_budget", int, None,
                          "Most reasoning tokens; at the limit the reasoning block is closed and the model answers "
                          "(0 = thinking off).", min=0, max=MAX_CONTEXT, nullable=True)   # None: no limit
MAX_TOTAL_TOKENS = Option("max_total_tokens", int, None,
                          "Most tokens of reasoning and answer together (max_tokens counts the answer alone).",
                          min=1, max=MAX_CONTEXT, nullable=True)   # None: the context is the limit
JSON_SCHEMA = Option("json_schema", dict, None,
                     "The JSON schema the answer must follow (compiled by llguidance; with thinking on it applies "
                     "to the answer only). A keyword that cannot be enforced is refused, naming it.", nullable=True)
#: `a3b generate`'s alone: where the reasoning is printed
SHOW_REASONING = Option("show_reasoning", bool, False,
                        "Print the reasoning on stdout before the answer (default: dimmed on stderr).")

POOLING = Option("pooling", str, POOLINGS[0], "How a text's token vectors become one vector.", choices=POOLINGS)
NORMALIZE = Option("normalize", bool, True, "Unit length, so a dot product is the cosine similarity.")

# -- llama-server's own fields, as `a3b serve` takes them ---------------------------------------------------
N_PREDICT = Option("n_predict", int, -1, "Most tokens to generate; -1 or 0 = the default.", min=-1,
                   max=MAX_TOKENS.max)
#: /infill's answer length where a request gives none: its editor clients expect short answers
INFILL_N_PREDICT = replace(N_PREDICT, default=128, min=1, help="Most tokens of an /infill answer.")
T_MAX_PREDICT_MS = Option("t_max_predict_ms", int, 0, "Time limit of an /infill generation, in ms; 0 = none.",
                          min=0, max=10**7)
N_INDENT = Option("n_indent", int, 0,
                  "Every line of the answer after the first must be indented by at least this many spaces or tabs; "
                  "the first one that is not ends the answer there (llama-server's field; 0 = off).",
                  min=0, max=MAX_CONTEXT)

# -- Ollama's request options, as `a3b serve` takes them (serve/ollama_protocol.py) ------------------------
NUM_PREDICT = Option("num_predict", int, -1,
                     "Most tokens to generate (Ollama's option); -1 = until the answer ends or the context is full.",
                     min=-1, max=MAX_CONTEXT)
NUM_CTX = replace(N_CTX, help="Context tokens of the request (Ollama's option): at most the served model's context, "
                  "which is fixed when it loads; a smaller value bounds prompt and answer together.")
KEEP_ALIVE = Option("keep_alive", float, None,
                    "How long a model stays loaded after a request (Ollama's keep_alive), in seconds or as a duration "
                    "such as 5m; 0 = unload once idle, negative = keep loaded; left out = the store's own policy "
                    "(loaded until evicted or unloaded).", min=-1e9, max=1e9, nullable=True)

# -- routing requests by task type (runtime/routing.py) -----------------------------------------------------
#: how a request's text becomes a vector for routing: the model's input token embeddings (a lookup in the
#: memory-mapped GGUF, no pass through the model) or its pooled output embedding (one pass over the head)
ROUTE_EMBEDDINGS = ("tokens", "model")
ROUTE_EMBEDDING = Option("route_embedding", str, "tokens",
                         "How the router embeds a request: tokens = the embedding model's input token vectors "
                         "(a table lookup, well under a millisecond), model = its pooled output embedding (one "
                         "pass through the model over the head of the request).", choices=ROUTE_EMBEDDINGS)
ROUTE_HEAD_TOKENS = Option("route_head_tokens", int, 48,
                           "Tokens of a request the router reads (the start of the last user message).",
                           min=4, max=4096)
ROUTE_RULE_HITS = Option("route_rule_hits", int, 2,
                         "Code signs (fences, file names, language keywords) that let the rules decide a request "
                         "for the code route without embedding it; 0 = always embed.", min=0, max=64)

# -- the servers' tokens ------------------------------------------------------------------------------------
LSP_TOKEN = Option("token", str, None, "Shared secret TCP/WebSocket editors must send.", nullable=True,
                   env="A3B_LSP_TOKEN")
SERVE_TOKEN = Option("token", str, None, "Bearer token every request must carry.", nullable=True,
                     env="A3B_SERVE_TOKEN")

# -- images (images.py) ----------------------------------------------------------------------------------
IMAGE_MAX_PIXELS = Option("image_max_pixels", int, 50_000_000,
                          "Largest image taken, in pixels (width x height), checked before it is decoded; the "
                          "projector then resizes it to what its model was trained on.", min=1, max=1 << 31,
                          env="A3B_IMAGE_MAX_PIXELS")
IMAGE_MAX_BYTES = Option("image_max_bytes", int, 32 << 20,
                         "Largest encoded image file taken (PNG, JPEG, ...), in bytes.", min=1, max=1 << 31,
                         env="A3B_IMAGE_MAX_BYTES")

# -- structured output (llama/grammar.py) -------------------------------------------------------------------
GRAMMAR_MAX_BYTES = Option("grammar_max_bytes", int, 256 << 10,
                           "Largest json_schema (as JSON text) or GBNF grammar taken, in bytes; a larger one is "
                           "refused before it is compiled.", min=1, max=1 << 30, env="A3B_GRAMMAR_MAX_BYTES")
GRAMMAR_TIMEOUT_S = Option("grammar_timeout_s", float, 10.0,
                           "Longest a json_schema or grammar may take to compile (off the request queue), in seconds; "
                           "a slower one is refused.", min=0.0, max=3600.0, low_open=True,
                           env="A3B_GRAMMAR_TIMEOUT_S")

#: the options of each runtime type, by field name
LOAD_OPTIONS = {o.name: o for o in (N_CTX, N_PARALLEL, N_GPU_LAYERS, N_THREADS, N_BATCH, FLASH_ATTN, KV_CACHE_TYPE,
                                     USE_MMAP, LORA_PATH, LORA_SCALE, SERVE_AS_OPTION, EMBED_N_CTX, MMPROJ,
                                     CTX_POLICY, SPECULATIVE, DRAFT_MAX, CPU_MOE, N_CPU_MOE, OVERRIDE_TENSOR,
                                     BACKEND_SAMPLING)}
SAMPLING_OPTIONS = {o.name: o for o in (TEMPERATURE, TOP_P, TOP_K, MIN_P, REPEAT_PENALTY, REPEAT_LAST_N, SEED,
                                        IGNORE_EOS, SAMPLERS)}
CONFIDENCE_OPTIONS = {o.name: o for o in (THRESHOLD, MIN_RUN)}
REQUEST_OPTIONS = {o.name: o for o in (MAX_TOKENS, LOGPROBS, THINKING, REASONING_BUDGET, MAX_TOTAL_TOKENS,
                                        JSON_SCHEMA, N_INDENT)}
#: every option above, by name
OPTIONS = {**LOAD_OPTIONS, **SAMPLING_OPTIONS, **CONFIDENCE_OPTIONS, **REQUEST_OPTIONS, POOLING.name: POOLING,
           NORMALIZE.name: NORMALIZE, IMAGE_MAX_PIXELS.name: IMAGE_MAX_PIXELS, IMAGE_MAX_BYTES.name: IMAGE_MAX_BYTES,
           GRAMMAR_MAX_BYTES.name: GRAMMAR_MAX_BYTES, GRAMMAR_TIMEOUT_S.name: GRAMMAR_TIMEOUT_S,
           **{o.name: o for o in (ROUTE_EMBEDDING, ROUTE_HEAD_TOKENS, ROUTE_RULE_HITS)}}


def check_fields(obj: Any, options: dict[str, Option]) -> None:
    """Check every field of dataclass `obj` that `options` declares."""
    for f in fields(obj):
        if f.name in options:
            check(options[f.name], getattr(obj, f.name))


@dataclass(frozen=True)
class LoadSpec:
    """A model file and how to load it. Hashable: the model store keys loaded contexts by it."""

    path: str
    # Each field's meaning, default and bounds: its Option above (LOAD_OPTIONS).
    n_ctx: int = N_CTX.default
    n_parallel: int = N_PARALLEL.default
    n_gpu_layers: int | str = N_GPU_LAYERS.default
    n_threads: int = N_THREADS.default
    n_batch: int = N_BATCH.default
    flash_attn: str = FLASH_ATTN.default
    kv_cache_type: str = KV_CACHE_TYPE.default
    use_mmap: bool = USE_MMAP.default
    lora_path: str | None = LORA_PATH.default
    lora_scale: float = LORA_SCALE.default
    #: see llama/reencode.py
    serve_as: str = SERVE_AS_OPTION.default
    embed_n_ctx: int = EMBED_N_CTX.default
    #: the multimodal projector: "auto" (beside the model), a path, or "off"
    mmproj: str = MMPROJ.default
    #: "warn" loads, logs a warning and reports it in status; "refuse" raises ContextTooLarge
    ctx_policy: str = CTX_POLICY.default
    #: see speculative.py
    speculative: str = SPECULATIVE.default
    draft_max: int = DRAFT_MAX.default
    #: tensor placement (runtime/llama/placement.py)
    cpu_moe: bool = CPU_MOE.default
    n_cpu_moe: int = N_CPU_MOE.default
    override_tensor: str | None = OVERRIDE_TENSOR.default
    #: see runtime/local/sampler_choice.py
    backend_sampling: str = BACKEND_SAMPLING.default

    def validate(self) -> None:
        check_fields(self, LOAD_OPTIONS)
        parse_speculative(self.speculative)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
