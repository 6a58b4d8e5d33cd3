"""Everything a caller can choose when loading a model, written once.

`LoadSpec` is the one declaration of the load options, their defaults and their checks; the lists of
choices below are the only ones in the project (the ComfyUI loader's dropdowns, the CLI's `choices=`
and the engine's lookup tables all read them). A spec is checked by `validate()` before any weights
load, so a typo in a KV cache type fails in microseconds with a message instead of inside llama.cpp.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import InvalidRequest

#: values of an on/off environment variable that mean off (any case, spaces around ignored)
OFF_WORDS = ("0", "off", "no", "false")


def switched_off(value: str) -> bool:
    """Whether an on/off environment variable's value says off."""
    return value.strip().lower() in OFF_WORDS

#: Embedding pooling over a text's tokens (llama.cpp's own pooling types).
POOLINGS = ("mean", "cls", "last")
#: llama.cpp's flash-attention setting.
FLASH_ATTN_MODES = ("auto", "on", "off")
#: KV cache element types llama.cpp takes for K and V (quantised V needs flash attention).
KV_CACHE_TYPES = ("f16", "q8_0", "q4_0", "f32", "bf16", "q5_0", "q5_1", "q4_1")
#: What to do when n_ctx exceeds the model's trained context.
CTX_POLICIES = ("warn", "refuse")
#: llama.cpp types a model can be served re-encoded in (llama/reencode.py), and serve_as's choices
SERVE_FORMATS = ("q8_0", "f16", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q6_k")
SERVE_AS = ("as-is", "auto", *SERVE_FORMATS)


def cache_root() -> Path:
    """Where re-encoded copies and pruned variants are cached: $A3B_CACHE, else the user's cache
    folder ($XDG_CACHE_HOME or ~/.cache) / comfyui-a3b. Created on first use by the callers."""
    base = os.environ.get("A3B_CACHE")
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
class LoadSpec:
    """A model file and how to load it. Hashable: the model store keys loaded contexts by it."""

    path: str
    #: Context tokens per sequence slot (one concurrent request: prompt + answer).
    n_ctx: int = 2048
    #: Sequence slots: how many requests decode together in one batch.
    n_parallel: int = 2
    #: Layers offloaded to a GPU: "auto" (as many as fit in the free GPU memory next to the KV cache;
    #: 0 without a GPU build or device), 0 = CPU only, -1 = all, N = the last N layers.
    n_gpu_layers: int | str = "auto"
    #: CPU threads; 0 = automatic (half the cores for decoding, all for prompts).
    n_threads: int = 0
    #: Tokens per decode step; prompts are read in chunks of this size.
    n_batch: int = 256
    flash_attn: str = "auto"
    kv_cache_type: str = "f16"
    use_mmap: bool = True
    lora_path: str | None = None
    lora_scale: float = 1.0
    #: Serve the file as is, a cached re-encoded copy ("q8_0", ...), or the faster of both ("auto");
    #: see llama/reencode.py.
    serve_as: str = "as-is"
    #: Longest text the embedding context takes, in tokens (RAG chunks beyond it are refused).
    embed_n_ctx: int = 256
    #: What to do when n_ctx exceeds the model's trained context: "warn" (load, log a warning and
    #: report it in status) or "refuse" (raise ContextTooLarge).
    ctx_policy: str = "warn"

    def validate(self) -> None:
        ints = {"n_ctx": self.n_ctx, "n_parallel": self.n_parallel, "n_threads": self.n_threads,
                "n_batch": self.n_batch, "embed_n_ctx": self.embed_n_ctx}
        if self.n_gpu_layers != "auto":
            ints["n_gpu_layers"] = self.n_gpu_layers
        for name, v in ints.items():
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidRequest(f"{name} must be an integer, got {v!r}")
        if self.n_ctx < 16:
            raise InvalidRequest(f"n_ctx must be at least 16, got {self.n_ctx}")
        if not 1 <= self.n_parallel <= 64:
            raise InvalidRequest(f"n_parallel must be in 1..64, got {self.n_parallel}")
        if not 8 <= self.embed_n_ctx <= 1 << 16:
            raise InvalidRequest(f"embed_n_ctx must be in 8..65536, got {self.embed_n_ctx}")
        if self.n_batch < 1:
            raise InvalidRequest(f"n_batch must be >= 1, got {self.n_batch}")
        if self.n_threads < 0:
            raise InvalidRequest(f"n_threads must be >= 0, got {self.n_threads}")
        if self.n_gpu_layers != "auto" and self.n_gpu_layers < -1:
            raise InvalidRequest(f"n_gpu_layers must be 'auto', -1 (all), 0 (CPU only) or a layer count, "
                                 f"got {self.n_gpu_layers}")
        for name, value, allowed in (("flash_attn", self.flash_attn, FLASH_ATTN_MODES),
                                     ("kv_cache_type", self.kv_cache_type, KV_CACHE_TYPES),
                                     ("ctx_policy", self.ctx_policy, CTX_POLICIES),
                                     ("serve_as", self.serve_as, SERVE_AS)):
            if value not in allowed:
                raise InvalidRequest(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        check_finite("lora_scale", self.lora_scale)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
