"""The in-process llama.cpp engine (the default engine; see engine.py for the interface).

binding.py   llama-cpp-python imported once, llama.cpp's log captured, the batch helper
weights.py   one loaded llama_model and its vocabulary; load-error classification
backend.py   contexts for one LoadSpec: decode, sample, embed
"""
from __future__ import annotations

import os
from pathlib import Path

from ..gguf_info import check_header
from ..options import LoadSpec
from ..serving import serving_path
from .backend import LlamaBackend, context_params, thread_counts
from .binding import GGML_TYPES, fill_batch, llama, llama_cpp_version, sequence, system_info
from .weights import Weights, probe_architecture, unsupported_error

#: bytes per KV cache element, by KV cache type
_KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
             "q4_1": 20 / 32, "q4_0": 18 / 32}


class LlamaEngine:
    """Local GGUF files run by llama.cpp in this process."""

    name = "llama.cpp"

    def check(self, spec: LoadSpec) -> None:
        # Missing and foreign files fail here with a typed error. The rest of the checks come from
        # llama.cpp's own loader (truncation, unknown architecture), which reads the metadata in a
        # fraction of the time the `gguf` package's full reader needs (~3 s for a 49k vocabulary).
        check_header(spec.path)

    def weights_key(self, spec: LoadSpec) -> tuple:
        st = os.stat(spec.path)
        return (spec.path, st.st_size, st.st_mtime_ns, spec.n_gpu_layers, spec.use_mmap, spec.serve_as)

    def file_bytes(self, spec: LoadSpec) -> int:
        return os.path.getsize(spec.path)

    def load_weights(self, spec: LoadSpec) -> Weights:
        load_path = serving_path(spec.path, spec.serve_as) if spec.serve_as != "as-is" else Path(spec.path)
        return Weights(load_path, n_gpu_layers=spec.n_gpu_layers, use_mmap=spec.use_mmap, name=Path(spec.path).name)

    def open(self, weights: Weights, spec: LoadSpec) -> LlamaBackend:
        return LlamaBackend(weights, spec)

    def kv_bytes(self, weights: Weights, spec: LoadSpec) -> int:
        """Size of the generation context's KV cache for this spec (all slots, all cells)."""
        n_embd_kv = weights.n_embd * (weights.n_head_kv or weights.n_head) // max(weights.n_head, 1)
        per_token = weights.n_layer * 2 * n_embd_kv * _KV_BYTES.get(spec.kv_cache_type, 2)
        return int(per_token * spec.n_ctx * spec.n_parallel)


ENGINE = LlamaEngine()

__all__ = ["ENGINE", "GGML_TYPES", "LlamaBackend", "LlamaEngine", "Weights", "context_params", "fill_batch",
           "llama", "llama_cpp_version", "probe_architecture", "sequence", "system_info", "thread_counts",
           "unsupported_error"]
