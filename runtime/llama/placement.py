"""Tensor placement for one load: the options checked against the file, the planner's choice, and
llama.cpp's `tensor_buft_overrides` built from it; after the load, what llama.cpp reports it did.

* `cpu_moe`, `n_cpu_moe` and `override_tensor` (runtime/options/) are checked before anything loads: a
  pattern that is not a regular expression, a device llama.cpp does not list, expert options on a
  model without experts, more overrides than llama.cpp takes, a placement whose GPU part is larger
  than the free memory: each is an InvalidRequest in one line. A pattern that matches no tensor is
  a warning that names it (the plan's warnings, the log).
* `choose` runs the planner (planner.py) for the file and the free memory of the first GPU.
* `Overrides` holds the NULL-terminated `llama_model_tensor_buft_override` array and its pattern
  bytes for as long as the model lives: llama.cpp keeps the pointer in the model's parameters.
  CPU is ggml's CPU buffer type (`ggml_backend_cpu_buffer_type`), a GPU its device's
  (`ggml_backend_dev_buffer_type`).
* `measured_from_log` reads llama.cpp's own account of the load: how many tensors an override
  placed, and the size of each buffer (weights, KV cache, compute) per device.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
from functools import lru_cache
from pathlib import Path

from ..errors import InvalidRequest
from ..models.ggufscan import Dims, scan_header, tensor_bytes
from ..options import LoadSpec, state_snapshots
from . import planner, tensorpatterns
from .planner import Layout, Override, Plan

log = logging.getLogger("a3b.llama")

#: what the expert options place: every routed expert tensor, or a dense model's FFN (shown in messages)
EXPERT_PATTERN = r"\.ffn_(gate|up|down|gate_up)_(ch)?exps"
DENSE_PATTERN = r"^blk\.\d+\.ffn_(gate|up|down)\.weight$"


def layout(path) -> Layout:
    """The tensor layout of a GGUF (planner.Layout), read once per file version from its index."""
    st = os.stat(path)
    return _layout(str(path), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=32)
def _layout(path: str, size: int, mtime_ns: int) -> Layout:
    import math

    scan = scan_header(path)
    dims = Dims.of(scan, path)
    named = []
    for name, shape, ttype, _ in scan.tensors:
        nbytes = tensor_bytes(shape, ttype)
        named.append((name, 2 * math.prod(shape) if nbytes is None else nbytes))   # unknown type: 16 bits a value
    return Layout.of(named, n_layer=dims.n_layer, n_head=dims.n_head, n_head_kv=dims.n_head_kv,
                     key_length=dims.key_length, value_length=dims.value_length, n_vocab=dims.n_vocab,
                     **recurrent(scan.metadata, dims.architecture, dims.n_layer))


def recurrent(meta: dict, arch: str, n_layer: int) -> dict:
    """A hybrid model's KV layers and per-sequence recurrent state (planner.Layout), from the
    header: qwen35's Gated DeltaNet layers sit between attention layers, one in every
    `full_attention_interval` being attention (llama.cpp: layer i is recurrent unless (i + 1) is a
    multiple of it). Per recurrent layer and sequence llama.cpp keeps a convolution state of
    (conv_kernel - 1) x (inner + 2 x groups x state) and a recurrent state of state x inner floats.
    {} for models without such layers, or a header whose values are not plausible."""
    def get(key: str) -> int:
        v = meta.get(f"{arch}.{key}")
        v = v[0] if isinstance(v, list) and v else v
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 20 else 0

    interval, inner, state = get("full_attention_interval"), get("ssm.inner_size"), get("ssm.state_size")
    if not (interval and inner and state):
        return {}
    conv, groups = get("ssm.conv_kernel"), get("ssm.group_count")
    floats = max(conv - 1, 0) * (inner + 2 * groups * state) + state * inner
    return {"kv_layers": tuple(i for i in range(n_layer) if (i + 1) % interval == 0), "rs_bytes": 4 * floats}


def split_entries(text: str | None) -> list[str]:
    """`REGEX=DEVICE` entries of an override_tensor text: comma-separated, a comma inside {} (a
    repetition count such as {1,3}) being part of the pattern."""
    if not text:
        return []
    out, depth, cur = [], 0, []
    for ch in text:
        depth += ch == "{"
        depth -= ch == "}" and depth > 0
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [e.strip() for e in out if e.strip()]


def parse_overrides(text: str | None, device_names: list[str]) -> list[tuple[str, str]]:
    """(pattern, device) pairs of `override_tensor`, each checked; InvalidRequest in one line otherwise."""
    pairs = []
    for entry in split_entries(text):
        pattern, sep, device = entry.rpartition("=")
        if not sep or not pattern or not device.strip():
            raise InvalidRequest(f"override_tensor entry {entry!r} is not REGEX=DEVICE (for example "
                                 f"'{EXPERT_PATTERN}=CPU').")
        tensorpatterns.compiled(pattern)   # RE2: what it cannot match in linear time is refused here
        if "(?P" in pattern or "(?<" in pattern or "(?#" in pattern:
            raise InvalidRequest(f"override_tensor pattern {pattern!r} uses Python-only syntax; llama.cpp reads "
                                 "ECMAScript regular expressions (no (?P<name>), lookbehind or (?#comments)).")
        device = device.strip()
        known = {"CPU": "CPU", **{n.upper(): n for n in device_names}}
        if device.upper() not in known:
            raise InvalidRequest(f"override_tensor device {device!r} does not exist here; devices: "
                                 f"{', '.join(['CPU', *device_names])}.")
        pairs.append((pattern, known[device.upper()]))
    return pairs


def layer_pattern(layers: int, n_layer: int, moe: bool) -> str:
    """One regular expression for the movable tensors of the first `layers` layers."""
    what = r"ffn_(gate|up|down|gate_up)_(ch)?exps" if moe else r"ffn_(gate|up|down)\.weight$"
    if layers >= n_layer:
        return tensorpatterns.ours(rf"^blk\.\d+\.{what}")
    return tensorpatterns.ours(rf"^blk\.({'|'.join(str(i) for i in range(layers))})\.{what}")


def max_overrides() -> int:
    from .binding import llama

    return int(llama().llama_max_tensor_buft_overrides())


def check_options(spec: LoadSpec, lay: Layout, name: str) -> None:
    """The expert options on a model without experts are an error that offers what applies."""
    if (spec.cpu_moe or spec.n_cpu_moe) and not lay.moe:
        asked = "cpu_moe" if spec.cpu_moe else f"n_cpu_moe={spec.n_cpu_moe}"
        raise InvalidRequest(f"{asked}: {name} is a dense model, it has no expert tensors. Its dense FFN tensors can "
                             f"go to the CPU instead: override_tensor '{DENSE_PATTERN}=CPU' (or leave n_gpu_layers "
                             "at auto, which moves them first when the GPU is too small).")


def choose(path, spec: LoadSpec, *, gpus: list, reserve_bytes: int = 0,
           cap_bytes: int | None = None) -> tuple[Plan, list]:
    """The plan for loading `path` with `spec` beside `gpus` (devices.Device, the first one planned
    for), and the (pattern, device) overrides to give llama.cpp, user's first."""
    lay = layout(path)
    name = Path(path).name
    check_options(spec, lay, name)
    user = parse_overrides(spec.override_tensor, [g.name for g in gpus])
    warnings = [f"override_tensor pattern {p!r} matches no tensor of {name}; it places nothing"
                for p, _ in user if not any(tensorpatterns.matches(p, t.name) for t in lay.tensors)]
    overrides = tuple(Override(p, d == "CPU") for p, d in user)
    fixed_n = lay.n_layer if spec.cpu_moe else (spec.n_cpu_moe or None)
    if fixed_n is None and (user or not spec.n_gpu_layers == "auto"):
        fixed_n = 0   # a placement given by hand: the planner adds no expert moves of its own
    gpu = bool(gpus)
    free = gpus[0].free_bytes if gpu else 0
    if cap_bytes is not None:
        free = min(free, cap_bytes + planner.MARGIN)
    n_gpu_layers = spec.n_gpu_layers
    p = planner.plan(lay, free_bytes=free, n_ctx=spec.n_ctx, n_parallel=spec.n_parallel, n_batch=spec.n_batch,
                     kv_type=spec.kv_cache_type, flash_attn=spec.flash_attn, reserve_bytes=reserve_bytes,
                     n_cpu_moe=fixed_n, n_gpu_layers=n_gpu_layers, overrides=overrides, gpu=gpu,
                     n_rs_seq=state_snapshots(spec.speculative, spec.draft_max))
    if not gpu and fixed_n is None:
        p.n_cpu_moe = 0   # nothing to move on a CPU-only build unless asked (the same memory either way)
    p.warnings = warnings + p.warnings
    if gpu and n_gpu_layers != "auto" and (spec.cpu_moe or spec.n_cpu_moe) and p.gpu_weights > free - planner.MARGIN:
        raise InvalidRequest(f"{name}: even with the experts on the CPU, the part asked for on the GPU needs about "
                             f"{(p.gpu_weights + planner.MARGIN) / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB is free. "
                             "Use n_gpu_layers auto (or fewer layers), or free GPU memory.")
    entries = list(user)
    if p.n_cpu_moe:
        entries.append((layer_pattern(p.n_cpu_moe, lay.n_layer, lay.moe), "CPU"))
    limit = max_overrides()
    if len(entries) + 1 > limit:
        raise InvalidRequest(f"override_tensor has {len(entries)} entries; llama.cpp takes at most {limit - 1} "
                             "(llama_max_tensor_buft_overrides). Join patterns with | instead.")
    for w in p.warnings:
        log.warning("%s: %s", name, w)
    return p, entries


def to_llama(path, entries: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The overrides llama.cpp gets for `entries` (choose's) over the file `path`: the exact tensor
    names each pattern matched (tensorpatterns.py), so that its backtracking matcher meets only
    patterns that cannot backtrack; the same placement."""
    if not entries:
        return []
    names = [t.name for t in layout(path).tensors]
    return tensorpatterns.for_llama(entries, names, max_overrides() - 1)


class _Override(ctypes.Structure):
    """llama.h's struct llama_model_tensor_buft_override."""
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class Overrides:
    """The NULL-terminated override array for llama_model_params, kept alive with the model."""

    def __init__(self, entries: list[tuple[str, str]]):
        from .devices import buffer_type

        self.entries = list(entries)
        self._patterns = [p.encode("utf-8") for p, _ in entries]
        arr = (_Override * (len(entries) + 1))()
        for i, ((_, device), pat) in enumerate(zip(entries, self._patterns)):
            arr[i].pattern = pat
            arr[i].buft = buffer_type(device)
        arr[len(entries)].pattern = None
        arr[len(entries)].buft = None
        self.array = arr

    @property
    def pointer(self) -> int:
        return ctypes.addressof(self.array)


_OVERRIDDEN = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)")
_BUFFER = re.compile(r"(\S+) (model|KV|compute|RS) buffer size\s*=\s*([\d.]+) MiB")


def measured_from_log(text: str) -> dict:
    """What llama.cpp logged about a load or a context: tensors an override placed (by buffer type)
    and the buffer sizes (bytes) by kind and device."""
    moved: dict[str, int] = {}
    for m in _OVERRIDDEN.finditer(text):
        moved[m.group(2)] = moved.get(m.group(2), 0) + 1
    buffers: dict[str, int] = {}
    for m in _BUFFER.finditer(text):
        key = f"{m.group(2)}:{m.group(1)}"
        buffers[key] = buffers.get(key, 0) + int(float(m.group(3)) * 2**20)
    return {"overridden_tensors": moved, "buffers": buffers}
