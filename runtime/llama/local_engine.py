"""The local engine: GGUF files run by llama.cpp in this process, each loaded once (Weights) and served
as a worker.LoadedModel over a LlamaBackend. The runtime makes it the default engine
(runtime/__init__.py); it lives beside the package's `__init__`, not in it, because its models
render chat prompts (worker.py, chat.py) through this package's templates.py, which imports the
package first.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..models import mmproj as mmprojmod
from ..models import vet
from ..engine import Engine, Model
from ..errors import CorruptGGUF, ModelLoadFailed, ModelNotFound
from ..models.ggufscan import check_header
from ..options import LoadSpec, parse_speculative
from ..local.worker import LoadedModel
from . import fitting, offload, placement, planner
from .backend import LlamaBackend
from .contexts import thread_counts
from .devices import gpus
from .reencode import serving_path
from .weights import Weights

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
        proj = mmprojmod.resolve(spec.path, spec.mmproj)
        pst = os.stat(proj) if proj is not None else None
        return (spec.path, st.st_size, st.st_mtime_ns, spec.n_gpu_layers, spec.use_mmap, spec.serve_as,
                spec.cpu_moe, spec.n_cpu_moe, spec.override_tensor,
                parse_speculative(spec.speculative)[0] == "mtp",   # loads the nextn layers too
                (str(proj), pst.st_size, pst.st_mtime_ns) if pst is not None else None)

    def file_bytes(self, spec: LoadSpec) -> int:
        return os.path.getsize(spec.path) + projector_bytes(spec)

    def load_weights(self, spec: LoadSpec) -> Weights:
        # vetted before anything here reads the header's values or re-encodes the file in this process
        vet.check_file(spec.path)
        load_path = serving_path(spec.path, spec.serve_as) if spec.serve_as != "as-is" else Path(spec.path)
        # the projector goes to the GPU with the model: its weights are not free for the model's tensors
        weights = fitting.load_planned(load_path, spec, Path(spec.path).name, reserve_extra=projector_bytes(spec))
        try:
            attach_projector(weights, spec, weights.info.n_gpu_layers)
        except BaseException:
            weights.free()
            raise
        return weights

    def open_model(self, weights: Weights, spec: LoadSpec, models: Callable[[LoadSpec], Model]) -> LoadedModel:
        plan = weights.info.placement
        shrunk = int(plan.get("n_ctx") or 0) < int(plan.get("n_ctx_asked") or 0)
        n_ctx = int(plan["n_ctx"]) if shrunk else spec.n_ctx
        if n_ctx < spec.n_ctx:   # the planner shrank the context to fit the GPU (said in its warnings)
            log.warning("%s: n_ctx %d -> %d per slot to fit the GPU", weights.info.name, spec.n_ctx, n_ctx)
        return LoadedModel.open(weights, LlamaBackend(weights, replace(spec, n_ctx=min(n_ctx, spec.n_ctx))), spec,
                                models)

    def smaller_placement(self, spec: LoadSpec, info, nbytes: int) -> int | None:
        """The device memory cap of a placement holding `nbytes` less than `info`'s with every layer
        still on the GPU (more experts in main memory), or None where there is none (runtime/models/handover.py)."""
        plan = info.placement
        if spec.n_gpu_layers != "auto" or spec.cpu_moe or not plan.get("gpu") or not plan.get("gpu_bytes"):
            return None
        # the bytes asked for are real ones: in the plan's units where the load measured more (or less)
        ratio = min(max(float(plan.get("measured", {}).get("gpu_vs_expected") or 1.0), 0.5), 2.0)
        cap = int(plan["gpu_bytes"] - nbytes / ratio)
        lay = placement.layout(info.path)
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
        return sum(layers) + output + kv + offload.FIXED_RESERVE + projector_bytes(spec)

    def kv_bytes(self, weights: Weights, spec: LoadSpec) -> int:
        """Size of the generation context's KV cache for this spec (all slots, all cells)."""
        n_embd_kv = weights.n_embd * (weights.n_head_kv or weights.n_head) // max(weights.n_head, 1)
        per_token = weights.n_layer * 2 * n_embd_kv * offload.KV_BYTES.get(spec.kv_cache_type, 2)
        return int(per_token * spec.n_ctx * spec.n_parallel)


def projector_bytes(spec: LoadSpec) -> int:
    """The size of the projector a load of `spec` takes (0: none), as the planner counts it."""
    try:
        proj = mmprojmod.resolve(spec.path, spec.mmproj)
        return os.path.getsize(proj) if proj is not None else 0
    except (OSError, ModelNotFound):
        return 0


def attach_projector(weights: Weights, spec: LoadSpec, n_gpu_layers: int) -> None:
    """Load the projector of `spec` over `weights` (vetted first, like a model file). One found
    beside the model ("auto") that does not fit it is left out with a warning; a named one is an error."""
    proj = mmprojmod.resolve(spec.path, spec.mmproj)
    if proj is None:
        return
    from .vision import Projector

    try:
        vet.check_file(proj, kind="mmproj", base=spec.path)   # loaded over the text model, an image encoded
        with weights.use():
            weights.projector = Projector(proj, weights.ptr, use_gpu=n_gpu_layers != 0,
                                          n_threads=thread_counts(spec.n_threads)[1], guard=weights.use)
    except (ModelLoadFailed, CorruptGGUF) as e:
        if spec.mmproj != "auto":
            raise
        log.warning("%s: the projector beside it (%s) was not loaded: %s", Path(spec.path).name, proj.name, e)
        return
    log.info("%s: projector %s loaded (%s)", Path(spec.path).name, proj.name,
             "GPU" if n_gpu_layers != 0 else "CPU")


ENGINE = LlamaEngine()
