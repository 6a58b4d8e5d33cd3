"""The load options: how a model file is loaded (`LoadSpec`, one field per Option in `LOAD_OPTIONS`),
with their lists of choices and the form of `speculative` (`parse_speculative`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import InvalidRequest
from .option import Option, check_fields

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
                     "Greedy output is the same either way.", form=parse_speculative)
DRAFT_MAX = Option("draft_max", int, 8, "Most tokens drafted per request and step (speculative decoding).",
                   min=1, max=64)

#: Sampling inside llama.cpp's graph (on the GPU where the model runs there): auto, on or off.
BACKEND_SAMPLING_MODES = ("auto", "on", "off")
BACKEND_SAMPLING = Option("backend_sampling", str, "auto",
                          "Draw tokens inside llama.cpp's compute graph (on the GPU when the model is there): requests "
                          "with confidence spans, their entropy measured there (auto); also greedy requests and "
                          "temperature chains, which the CPU drew faster (on); never (off). A repeat penalty, a "
                          "grammar or logprobs keep the CPU sampler.", choices=BACKEND_SAMPLING_MODES)

#: the options of each runtime type, by field name
LOAD_OPTIONS = {o.name: o for o in (N_CTX, N_PARALLEL, N_GPU_LAYERS, N_THREADS, N_BATCH, FLASH_ATTN, KV_CACHE_TYPE,
                                     USE_MMAP, LORA_PATH, LORA_SCALE, SERVE_AS_OPTION, EMBED_N_CTX, MMPROJ,
                                     CTX_POLICY, SPECULATIVE, DRAFT_MAX, CPU_MOE, N_CPU_MOE, OVERRIDE_TENSOR,
                                     BACKEND_SAMPLING)}


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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["FLASH_ATTN_MODES", "KV_CACHE_TYPES", "CTX_POLICIES", "SERVE_FORMATS", "SERVE_AS", "MAX_CONTEXT", "N_CTX",
           "N_PARALLEL", "N_GPU_LAYERS", "N_THREADS", "N_BATCH", "FLASH_ATTN", "KV_CACHE_TYPE", "USE_MMAP",
           "LORA_PATH", "LORA_SCALE", "SERVE_AS_OPTION", "EMBED_N_CTX", "MMPROJ", "CPU_MOE", "N_CPU_MOE",
           "OVERRIDE_TENSOR", "CTX_POLICY", "SPECULATIVE_MODES", "parse_speculative", "state_snapshots",
           "SPECULATIVE", "DRAFT_MAX", "BACKEND_SAMPLING_MODES", "BACKEND_SAMPLING", "LOAD_OPTIONS", "LoadSpec"]
