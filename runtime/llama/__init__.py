"""The in-process llama.cpp engine (the default engine; see engine.py for the interface): its models
are worker.LoadedModel over a LlamaBackend.

binding.py   llama-cpp-python imported once, llama.cpp's log captured, the batch helper
weights.py   one loaded llama_model and its vocabulary; load-error classification
backend.py   contexts for one LoadSpec: decode, sample, embed
planner.py   where each tensor goes (pure policy); placement.py and fitting.py apply it to a load
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from .. import vet
from ..engine import Engine
from ..gguf_info import check_header
from ..options import LoadSpec
from . import fitting, offload, placement, planner
from .devices import gpus
from ..serving import serving_path
from ..worker import LoadedModel
from .backend import LlamaBackend, context_params, thread_counts
from .binding import GGML_TYPES, fill_batch, llama, llama_cpp_version, sequence, system_info
from .weights import Weights, probe_architecture, unsupported_error

log = logging.getLogger("a3b.llama")


class LlamaEngine(Engine):
    """Local GGUF files run by llama.cpp in this process."""

    name = "llama.cpp"

    def check(self, spec: LoadSpec) -> None:
        # Missing and foreign files fail here with a typed error. The rest of the checks come from
        # llama.cpp's own loader (truncation, unknown architecture), which reads the metadata in a
        # fraction of the time the `gguf` package's full reader needs (~3 s for a 49k vocabulary).
        check_header(spec.path)

    def weights_key(self, spec: LoadSpec) -> tuple:
        st = os.stat(spec.path)
        return (spec.path, st.st_size, st.st_mtime_ns, spec.n_gpu_layers, spec.use_mmap, spec.serve_as,
                spec.cpu_moe, spec.n_cpu_moe, spec.override_tensor)

    def file_bytes(self, spec: LoadSpec) -> int:
        return os.path.getsize(spec.path)

    def load_weights(self, spec: LoadSpec) -> Weights:
        # vetted before anything here reads the header's values or re-encodes the file in this process
        vet.check_file(spec.path)
        load_path = serving_path(spec.path, spec.serve_as) if spec.serve_as != "as-is" else Path(spec.path)
        return fitting.load_planned(load_path, spec, Path(spec.path).name)

    def open_model(self, weights: Weights, spec: LoadSpec) -> LoadedModel:
        plan = weights.info.placement
        shrunk = int(plan.get("n_ctx") or 0) < int(plan.get("n_ctx_asked") or 0)
        n_ctx = int(plan["n_ctx"]) if shrunk else spec.n_ctx
        if n_ctx < spec.n_ctx:   # the planner shrank the context to fit the GPU (said in its warnings)
            log.warning("%s: n_ctx %d -> %d per slot to fit the GPU", weights.info.name, spec.n_ctx, n_ctx)
        return LoadedModel(weights, LlamaBackend(weights, replace(spec, n_ctx=min(n_ctx, spec.n_ctx))), spec)

    def smaller_placement(self, spec: LoadSpec, info, nbytes: int) -> int | None:
        """The device memory cap of a placement holding `nbytes` less than `info`'s with every layer
        still on the GPU (more experts in main memory), or None where there is none (runtime/handover.py)."""
        plan = info.placement
        if spec.n_gpu_layers != "auto" or spec.cpu_moe or not plan.get("gpu") or not plan.get("gpu_bytes"):
            return None
        # the bytes asked for are real ones: in the plan's units where the load measured more (or less)
        ratio = min(max(float(plan.get("measured", {}).get("gpu_vs_expected") or 1.0), 0.5), 2.0)
        cap = int(plan["gpu_bytes"] - nbytes / ratio)
        path = info.path
        lay = placement.layout(path)
        if cap <= 0 or not lay.movable_bytes():
            return None
        p = planner.plan(lay, free_bytes=cap + planner.MARGIN, n_ctx=spec.n_ctx, n_parallel=spec.n_parallel,
                         n_batch=spec.n_batch, kv_type=spec.kv_cache_type, flash_attn=spec.flash_attn,
                         n_cpu_moe=spec.n_cpu_moe or None)
        return cap if p.full and p.n_cpu_moe > info.n_cpu_moe and p.n_ctx == spec.n_ctx else None

    def gpus(self) -> list:
        return gpus()

    def gpu_bytes(self, spec: LoadSpec) -> int:
        """GPU memory the whole model would take with this spec (weights, KV cache, compute)."""
        layers, output, dims = offload.model_sizes(spec.path)
        kv = offload.kv_bytes_per_layer(dims, spec.n_ctx * spec.n_parallel, spec.kv_cache_type) * len(layers)
        return sum(layers) + output + kv + offload.FIXED_RESERVE

    def kv_bytes(self, weights: Weights, spec: LoadSpec) -> int:
        """Size of the generation context's KV cache for this spec (all slots, all cells)."""
        n_embd_kv = weights.n_embd * (weights.n_head_kv or weights.n_head) // max(weights.n_head, 1)
        per_token = weights.n_layer * 2 * n_embd_kv * offload.KV_BYTES.get(spec.kv_cache_type, 2)
        return int(per_token * spec.n_ctx * spec.n_parallel)


ENGINE = LlamaEngine()

__all__ = ["ENGINE", "GGML_TYPES", "LlamaBackend", "LlamaEngine", "Weights", "context_params", "fill_batch",
           "llama", "llama_cpp_version", "probe_architecture", "sequence", "system_info", "thread_counts",
           "unsupported_error"]
