"""Whole-layer offload: the layer-only estimate the planner (planner.py) replaced for
`n_gpu_layers="auto"`, kept for the whole-model size (`gpu_bytes`), the layer clamp and the
main-memory check.

The estimate reads the GGUF's tensor index (ggufscan.scan_header: sizes exactly as stored, every
quantisation type included, each tensor inside the file) and the load options. It runs before
llama.cpp has accepted the file, so it reads the header's numbers through ggufscan.Dims, each
bounded (a crafted block_count is an error, not four billion layers):

* each layer's weights (the `blk.N.*` tensors) and its share of the KV cache (n_ctx x n_parallel
  cells of K and V for that layer, in the KV cache type);
* the output layer (`output.weight`, `output_norm`), which llama.cpp puts on the GPU only when every
  layer is there (n_gpu_layers = n_layer + 1);
* a compute reserve: llama.cpp's scratch buffers grow with the batch and the vocabulary
  (the logits of a batch), plus a fixed margin for the CUDA context itself.

llama.cpp offloads the last layers first, so the plan fills the free memory from the top layer
down. It is an estimate: llama.cpp's own buffers can differ by some percent, hence the margin.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from functools import lru_cache

from ..models.ggufscan import Dims, scan_header, tensor_bytes
from .planner import KV_BYTES, MARGIN

#: CUDA context, cuBLAS workspaces and fragmentation: kept free whatever the model
FIXED_RESERVE = MARGIN
_BLK = re.compile(r"^blk\.(\d+)\.")


@dataclass
class OffloadPlan:
    n_gpu_layers: int            # what to give llama.cpp (n_layer + 1 = every layer and the output)
    n_layer: int
    gpu_bytes: int               # estimated device memory of the plan
    free_bytes: int              # device memory free when planning
    layer_bytes: int             # weights + KV of one (average) layer
    reason: str

    def describe(self) -> str:
        return (f"{min(self.n_gpu_layers, self.n_layer)}/{self.n_layer} layers"
                f"{' + output' if self.n_gpu_layers > self.n_layer else ''} on the GPU "
                f"(about {self.gpu_bytes / 2**30:.1f} GiB of {self.free_bytes / 2**30:.1f} GiB free): {self.reason}")


def model_sizes(path) -> tuple[tuple[int, ...], int, Dims]:
    """(bytes of each layer's weights, bytes of the output layer, the bounded hyperparameters); read
    once per file version. Raises CorruptGGUF for a header value beyond its bound (ggufscan.Dims):
    this runs before llama.cpp has accepted the file."""
    st = os.stat(path)
    return _model_sizes(str(path), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=32)
def _model_sizes(path: str, size: int, mtime_ns: int) -> tuple[tuple[int, ...], int, Dims]:
    scan = scan_header(path)
    dims = Dims.of(scan, path)
    n_layer = dims.n_layer
    layers = [0] * n_layer      # at most MAX_LAYERS
    output = embedding = 0
    has_output = False
    for name, shape, ttype, _ in scan.tensors:
        m = _BLK.match(name)
        size = tensor_bytes(shape, ttype)
        size = 2 * math.prod(shape) if size is None else size   # a type unknown to gguf: 16 bits a value
        if m and int(m.group(1)) < n_layer:
            layers[int(m.group(1))] += size
        elif name.startswith("output"):
            output += size
            has_output = has_output or name == "output.weight"
        elif name == "token_embd.weight":
            embedding = size
    if not has_output:
        output += embedding   # tied embeddings: the output layer on the GPU is a copy of token_embd
    return tuple(layers), output, dims


def kv_bytes_per_layer(dims: Dims, n_cells: int, kv_type: str) -> int:
    return int(n_cells * dims.n_head_kv * (dims.key_length + dims.value_length) * KV_BYTES.get(kv_type, 2))


def plan(path, *, n_ctx: int, n_parallel: int, n_batch: int, kv_cache_type: str, free_bytes: int,
         reserve_bytes: int = 0) -> OffloadPlan:
    """The most layers that fit in `free_bytes` (minus the reserves), from the top layer down."""
    layers, output, dims = model_sizes(path)
    n_layer = len(layers)
    n_vocab = dims.n_vocab or 32000
    kv_layer = kv_bytes_per_layer(dims, n_ctx * n_parallel, kv_cache_type)
    compute = FIXED_RESERVE + 2 * max(n_batch, n_parallel) * n_vocab * 4 + reserve_bytes
    budget = free_bytes - compute
    used, n = 0, 0
    for size in reversed(layers):             # llama.cpp offloads the last layers first
        if used + size + kv_layer > budget:
            break
        used += size + kv_layer
        n += 1
    if n == n_layer and used + output <= budget:
        used += output
        n = n_layer + 1                        # the output layer too
        reason = "the whole model fits"
    elif n == 0:
        reason = "not even one layer fits next to the compute buffers"
    else:
        reason = "as many layers as fit in the free memory"
    per_layer = (sum(layers) // max(n_layer, 1)) + kv_layer
    return OffloadPlan(n, n_layer, used + (compute if n else 0), free_bytes, per_layer, reason)


def clamp_layers(n: int, n_layer: int) -> tuple[int, str | None]:
    """`n_gpu_layers` as llama.cpp will apply it, and a note when the request was larger than the model.

    llama.cpp takes any count above n_layer + 1 (every layer and the output) as "everything" without
    a word; saying so tells a user that 99 meant all 36 layers, not that 99 layers exist."""
    if n_layer > 0 and n > n_layer + 1:
        return n_layer + 1, (f"n_gpu_layers={n} is more than the model's {n_layer} layers + output: "
                             f"all {n_layer} layers and the output on the GPU")
    return n, None


def host_bytes(path, *, n_gpu_layers: int, n_ctx: int, n_parallel: int, kv_cache_type: str) -> int:
    """Bytes of main memory the layers left on the CPU need: their weights and their KV cache."""
    layers, output, dims = model_sizes(path)
    n_layer = len(layers)
    on_gpu = n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer + 1)
    cpu_layers = layers[:max(n_layer - on_gpu, 0)]           # the last layers go to the GPU first
    kv = kv_bytes_per_layer(dims, n_ctx * n_parallel, kv_cache_type) * len(cpu_layers)
    return sum(cpu_layers) + (output if on_gpu <= n_layer else 0) + kv


def check_fits_in_memory(needed: int, total_ram: int, name: str) -> None:
    """Refuse, before loading, a model whose CPU part is larger than this machine's memory.

    Memory-mapped weights larger than the RAM still "load", then every token reads the file from
    disk again: minutes per token, with the rest of the machine (ComfyUI included) starved of page
    cache. That is never what a user wants, so it is an error that says what would fit."""
    from ..errors import ModelLoadFailed

    if total_ram and needed > total_ram:
        raise ModelLoadFailed(
            f"{name} needs about {needed / 2**30:.1f} GiB of main memory for what stays on the CPU (weights and "
            f"KV cache), more than this machine's {total_ram / 2**30:.1f} GiB. Offload layers to a GPU "
            "(n_gpu_layers), use a smaller quantisation or model, or a smaller n_ctx / n_parallel.")
