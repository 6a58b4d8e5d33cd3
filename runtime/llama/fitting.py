"""Loading weights with a placement plan, and measuring what the load really took.

`load_planned` asks placement.py for the plan (the first GPU's free memory, less what a hand-over
asks to keep free: runtime/models/handover.py), checks the main memory, loads the weights with the plan's
layers and tensor overrides, and records the device memory free before and after (the weights'
share), llama.cpp's buffer sizes and the tensors its overrides placed. `measure_context` adds the
same for a context (KV cache and compute buffers), so the status shows expected against measured.
"""
from __future__ import annotations

import logging
from pathlib import Path

from ..models import handover
from ..errors import InvalidRequest
from ..options import LoadSpec, parse_speculative
from . import offload, placement
from .binding import llama, log_mark, log_since
from .devices import gpu_free_bytes, gpus
from .weights import Weights

log = logging.getLogger("a3b.llama")


def _cpu_only_refusal(spec: LoadSpec) -> None:
    n = spec.n_gpu_layers
    if n not in ("auto", 0) and not llama().llama_supports_gpu_offload():
        raise InvalidRequest(
            f"n_gpu_layers={n} asks for the GPU, but the installed llama-cpp-python was built for the CPU only. "
            "Use n_gpu_layers 0 (or 'auto'), or install a GPU build: see the README's GPU section "
            "(CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install --force-reinstall --no-cache-dir llama-cpp-python).")


def plan_for(path, spec: LoadSpec, reserve_extra: int = 0):
    """(plan, overrides, line for the status) for loading `path` with `spec` now; `reserve_extra`:
    device memory something loaded with the model takes besides it (a projector)."""
    _cpu_only_refusal(spec)
    found = gpus()
    n = spec.n_gpu_layers
    if isinstance(n, int) and n > 0:
        n, note = offload.clamp_layers(n, placement.layout(path).n_layer)
        if note:
            log.info("%s: %s", Path(path).name, note)
        from dataclasses import replace

        spec = replace(spec, n_gpu_layers=n)
    p, entries = placement.choose(path, spec, gpus=found, reserve_bytes=handover.reserve_bytes() + reserve_extra,
                                  cap_bytes=handover.cap_bytes())
    if not found:
        why = ("CPU only: this llama-cpp-python has no GPU backend" if not llama().llama_supports_gpu_offload()
               else "CPU only: no GPU found")
        how = why + (f"; {len(entries)} tensor override(s) to the CPU buffer type" if entries else "")
    elif spec.n_gpu_layers == "auto":
        how = f"auto: {p.describe()}"
    else:
        how = p.describe()
    log.info("%s: %s", Path(path).name, how)
    return p, entries, how


def load_planned(path, spec: LoadSpec, name: str, reserve_extra: int = 0) -> Weights:
    p, entries, how = plan_for(path, spec, reserve_extra)
    offload.check_fits_in_memory(p.host_bytes, total_memory(), name)
    before = gpu_free_bytes()
    w = Weights(path, n_gpu_layers=p.n_gpu_layers if p.gpu else 0, use_mmap=spec.use_mmap, name=name, offload=how,
                overrides=placement.to_llama(path, entries), placement=p.as_dict(),
                load_mtp=parse_speculative(spec.speculative)[0] == "mtp")
    after = gpu_free_bytes()
    info = w.info.placement
    info["overrides"] = [f"{pat}={dev}" for pat, dev in entries]
    info["n_ctx_asked"] = spec.n_ctx
    info["measured"] = {**placement.measured_from_log(w.load_log), "seconds": w.load_seconds}
    if before is not None and after is not None:
        info["measured"]["gpu_weights_bytes"] = before - after
    return w


def measure_context(weights: Weights, create):
    """create() (a context over `weights`), with the device memory and buffers it took recorded."""
    mark, before = log_mark(), gpu_free_bytes()
    ctx = create()
    after = gpu_free_bytes()
    m = weights.info.placement.setdefault("measured", {})
    bufs = placement.measured_from_log(log_since(mark))["buffers"]
    m.setdefault("buffers", {}).update(bufs)
    if before is not None and after is not None:
        m["gpu_context_bytes"] = m.get("gpu_context_bytes", 0) + before - after
        m["gpu_bytes"] = m.get("gpu_weights_bytes", 0) + m["gpu_context_bytes"]
        expected = weights.info.placement.get("gpu_bytes") or 0
        if expected:
            m["gpu_vs_expected"] = round(m["gpu_bytes"] / expected, 3)
            log.info("%s: %.2f GiB of GPU memory measured after the load, %.2f GiB expected (%.2fx)",
                     weights.info.name, m["gpu_bytes"] / 2**30, expected / 2**30, m["gpu_vs_expected"])
    return ctx


def total_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - an unknown size only turns the check off
        return 0


#: bytes per KV cache element of each cache type (q8_0: 34 bytes a block of 32; q4_0: 18; ...)
KV_TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
                 "q4_1": 20 / 32, "q4_0": 18 / 32}


def kv_stream_bytes(weights, spec) -> float:
    """About what one slot's KV stream holds (keys and values of every layer over n_ctx cells): what
    moving a slot copies."""
    head = weights.n_embd // max(1, weights.n_head)
    return weights.n_layer * spec.n_ctx * 2 * weights.n_head_kv * head * KV_TYPE_BYTES.get(spec.kv_cache_type, 2)
