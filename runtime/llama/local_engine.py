"""The local engine: GGUF files run by llama.cpp in this process, each loaded once (Weights) and served
as a worker.LoadedModel over a LlamaBackend. The runtime makes it the default engine
(runtime/__init__.py); it lives beside the package's `__init__`, not in it, because its models
render chat prompts (worker.py, chat.py) through this package's templates.py, which imports the
package first.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from .. import mmproj as mmprojmod
from .. import vet
from ..engine import Engine
from ..errors import CorruptGGUF, InvalidRequest, ModelLoadFailed, ModelNotFound
from ..gguf_info import check_header
from ..options import LoadSpec
from ..worker import LoadedModel
from . import offload
from .backend import LlamaBackend, thread_counts
from .binding import llama
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
                (str(proj), pst.st_size, pst.st_mtime_ns) if pst is not None else None)

    def file_bytes(self, spec: LoadSpec) -> int:
        return os.path.getsize(spec.path) + projector_bytes(spec)

    def load_weights(self, spec: LoadSpec) -> Weights:
        # vetted before anything here reads the header's values or re-encodes the file in this process
        vet.check_file(spec.path)
        load_path = serving_path(spec.path, spec.serve_as) if spec.serve_as != "as-is" else Path(spec.path)
        n_gpu_layers, how = gpu_layers(load_path, spec)
        offload.check_fits_in_memory(
            offload.host_bytes(load_path, n_gpu_layers=n_gpu_layers, n_ctx=spec.n_ctx, n_parallel=spec.n_parallel,
                               kv_cache_type=spec.kv_cache_type), total_memory(), Path(spec.path).name)
        weights = Weights(load_path, n_gpu_layers=n_gpu_layers, use_mmap=spec.use_mmap, name=Path(spec.path).name,
                          offload=how)
        try:
            attach_projector(weights, spec, n_gpu_layers)
        except BaseException:
            weights.free()
            raise
        return weights

    def open_model(self, weights: Weights, spec: LoadSpec) -> LoadedModel:
        return LoadedModel(weights, LlamaBackend(weights, spec), spec)

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


def gpu_layers(path, spec: LoadSpec) -> tuple[int, str]:
    """The n_gpu_layers to load `path` with, and a line saying why."""
    n = spec.n_gpu_layers
    if n == "auto":
        found = gpus()
        if not found:
            why = ("CPU only: this llama-cpp-python has no GPU backend" if not llama().llama_supports_gpu_offload()
                   else "CPU only: no GPU found")
            return 0, why
        # the projector goes to the GPU with the model: its weights are not free for the layers
        p = offload.plan(path, n_ctx=spec.n_ctx, n_parallel=spec.n_parallel, n_batch=spec.n_batch,
                         kv_cache_type=spec.kv_cache_type,
                         free_bytes=max(0, found[0].free_bytes - projector_bytes(spec)))
        log.info("%s: %s", Path(path).name, p.describe())
        return p.n_gpu_layers, f"auto: {p.describe()}"
    if n != 0 and not llama().llama_supports_gpu_offload():
        raise InvalidRequest(
            f"n_gpu_layers={n} asks for the GPU, but the installed llama-cpp-python was built for the CPU only. "
            "Use n_gpu_layers 0 (or 'auto'), or install a GPU build: see the README's GPU section "
            "(CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install --force-reinstall --no-cache-dir llama-cpp-python).")
    if n > 0:
        n, note = offload.clamp_layers(n, len(offload.model_sizes(path)[0]))
        if note:
            log.info("%s: %s", Path(path).name, note)
            return n, note
    return n, ("CPU only" if n == 0 else f"{'all' if n < 0 else n} layers on the GPU, as asked")


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
        vet.check_file(proj, kind="mmproj")
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


def total_memory() -> int:
    """This machine's main memory in bytes (0 where unknown: then nothing is refused)."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - an unknown size only turns the check off
        return 0


ENGINE = LlamaEngine()
