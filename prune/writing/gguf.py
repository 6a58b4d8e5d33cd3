"""Write a pruned GGUF one tensor at a time, every tensor in its source type (no torch).

The header (metadata and every tensor's name, shape and type) is written first; then each tensor's
bytes are produced and written in turn, so memory holds one tensor at a time, never the model.
Unchanged tensors are copied byte for byte; row subsets (ffn_gate / ffn_up, whose rows are quantised
independently) are sliced from the stored bytes; tensors given as float values (a re-fitted
ffn_down, trained tensors) are quantised by llama.cpp's own quantiser (`ggml_quantize_chunk`, the
function `llama_model_quantize` calls) to the type the source stored that tensor in, so a mixed-type
file (Q4_K_M mixes Q4_K, Q6_K, Q5_0, Q8_0, F32) keeps each tensor's type.

Every path writes this way: the torch path gives its changed tensors as a dict (`tensors_from_changes`:
float arrays, or `RawTensor` row subsets of stored bytes), the streamed paths give `OutTensor`s whose
bytes are made when written. The file appears under its final name only when complete
(files.atomic_path), and the free space of the output's folder is checked against the output's size
before anything is written.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...runtime.errors import A3BError
from ...runtime.llama.ggml import block_size, row_size
from ...runtime.llama.quantize import quantize_rows
from ..files import atomic_path
from ..source import SourceModel
from .align import down_type

A3B_VERSION = 1
#: Room kept free beside the output (the header, the file system's own needs).
DISK_MARGIN = 64 << 20


class NotEnoughDisk(A3BError):
    code = "not_enough_disk"


@dataclass
class OutTensor:
    name: str
    qtype: int                          # GGMLQuantizationType value
    shape: tuple[int, ...]              # numpy shape, rows first (ne reversed)
    produce: Callable[[], np.ndarray]   # the stored bytes (or a float32 array for F32 tensors)

    @property
    def nbytes(self) -> int:
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        return rows * row_size(self.qtype, self.shape[-1])


class RawTensor:
    """Stored (possibly quantised) bytes of a tensor, written as they are."""

    def __init__(self, data: np.ndarray, qtype):
        self.data = np.ascontiguousarray(data)
        self.qtype = qtype

    @classmethod
    def rows(cls, tensor, rows: np.ndarray) -> RawTensor:
        """A row subset of a GGUF tensor: each row of a matrix is quantised on its own."""
        return cls(np.asarray(tensor.data)[np.asarray(rows)], tensor.tensor_type)


def encode(values: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """float values -> the bytes of ggml type `qtype` (F32 as is; everything else by llama.cpp's quantiser)."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == 0:  # F32
        return v
    flat = v.reshape(-1, v.shape[-1]) if v.ndim > 1 else v.reshape(1, -1)
    return quantize_rows(flat, qtype, imatrix)


def copy_tensor(src: SourceModel, name: str) -> OutTensor:
    return OutTensor(name, src.qtype(name), src.shape(name), lambda: src.stored(name))


def rows_tensor(src: SourceModel, name: str, rows: np.ndarray) -> OutTensor:
    shape = src.shape(name)
    return OutTensor(name, src.qtype(name), (len(rows), *shape[1:]),
                     lambda: np.ascontiguousarray(src.stored(name)[np.asarray(rows)]))


def value_tensor(name: str, qtype: int, shape: tuple[int, ...], make: Callable[[], np.ndarray],
                 imatrix: Callable[[], np.ndarray | None] | None = None) -> OutTensor:
    """A tensor given by float values (made when written), stored as `qtype`."""
    return OutTensor(name, qtype, shape, lambda: encode(make(), qtype, imatrix() if imatrix else None))


def output_bytes(tensors: list[OutTensor]) -> int:
    return sum(t.nbytes + 32 for t in tensors)


def check_disk(path: Path, need: int) -> None:
    """Refuse before writing when the output's folder has less free space than the output needs."""
    free = shutil.disk_usage(Path(path).parent).free
    if free < need + DISK_MARGIN:
        raise NotEnoughDisk(f"the pruned file needs about {need / 1e6:.0f} MB and {Path(path).parent} has "
                            f"{free / 1e6:.0f} MB free; free some space or choose another --out.")


def copy_kv(w, src: SourceModel, skip: set[str]) -> None:
    from gguf import GGUFValueType

    for name, f in src.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in skip:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub_type=sub)


def add_a3b(w, a3b: dict[str, Any]) -> None:
    from gguf import GGUFValueType

    for k, v in a3b.items():
        key = k if k.startswith("a3b.") else f"a3b.{k}"
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v) if v >= 0 else w.add_int32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        elif isinstance(v, (list, tuple, np.ndarray)):
            vals = list(v)
            if vals and all(isinstance(x, str) for x in vals):
                w.add_array(key, vals)
            elif vals and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0 for x in vals):
                w.add_key_value(key, [int(x) for x in vals], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
            else:
                w.add_key_value(key, [float(x) for x in vals], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
        else:
            raise TypeError(f"cannot store {key}={v!r} in GGUF metadata")


def write(src: SourceModel, path: str | Path, tensors: list[OutTensor], *, n_ff: int | None, a3b: dict[str, Any],
          n_head: int | None = None, progress: bool = False, should_stop: Callable[[], bool] | None = None,
          kv: dict[str, int | list[int]] | None = None) -> None:
    """Write `tensors` (in this order) with `src`'s metadata, the new FFN width and query head count and
    the a3b.* keys to `path` (the caller's temporary name).

    `n_ff` None keeps the source's FFN width key as it is; `kv` replaces (or adds) unsigned integer
    keys, one value or one per layer (a mixture-of-experts file's expert count and widths).
    """
    import gguf
    from tqdm import tqdm

    arch = src.info.architecture
    w = gguf.GGUFWriter(str(path), arch)
    skip = {k for k in src.fields if k.startswith("a3b.")} | set(kv or {})
    if n_ff is not None:
        skip.add(f"{arch}.feed_forward_length")
    heads_change = n_head is not None and n_head != src.hp.n_head
    if heads_change:
        skip |= {f"{arch}.attention.head_count", f"{arch}.attention.key_length", f"{arch}.attention.value_length"}
    copy_kv(w, src, skip)
    if n_ff is not None:
        w.add_feed_forward_length(int(n_ff))
    for key, v in (kv or {}).items():
        if isinstance(v, (list, tuple)):
            w.add_key_value(key, [int(x) for x in v], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
        else:
            w.add_uint32(key, int(v))
    if heads_change:
        w.add_head_count(int(n_head))
        w.add_key_length(int(src.hp.head_dim))
        w.add_value_length(int(src.meta(f"{arch}.attention.value_length", src.hp.head_dim)))
    add_a3b(w, {"version": A3B_VERSION, **a3b})
    for t in tensors:
        rows = t.shape[:-1] if len(t.shape) > 1 else ()
        byte_shape = (*rows, row_size(t.qtype, t.shape[-1]))
        w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes,
                          raw_dtype=gguf.GGMLQuantizationType(t.qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = tqdm(total=sum(t.nbytes for t in tensors), desc="writing", unit="B", unit_scale=True, disable=not progress)
    try:
        for t in tensors:
            if should_stop is not None and should_stop():
                raise KeyboardInterrupt
            data = t.produce()
            if data.nbytes != t.nbytes:
                raise RuntimeError(f"{t.name}: produced {data.nbytes} bytes, the header says {t.nbytes}")
            w.write_tensor_data(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
            del data
            src.release(t.name)   # its pages of the source's map: see SourceModel.release
            bar.update(t.nbytes)
    finally:
        bar.close()
        w.close()


def write_file(src: SourceModel, out: str | Path, tensors: list[OutTensor], **kwargs: Any) -> None:
    """Check the output folder's free space, then `write` to `out`, which appears only when complete."""
    check_disk(Path(out), output_bytes(tensors))
    with atomic_path(out, force=True) as tmp:
        write(src, tmp, tensors, **kwargs)


def tensors_from_changes(src: SourceModel, changed: dict[str, Any]) -> list[OutTensor]:
    """Every source tensor (and new ones) with `changed` applied: RawTensor row subsets as bytes, float
    arrays quantised to the source tensor's type (F32 for new tensors and 1-D quantised ones)."""
    out = []
    for name in list(src.tensors) + [n for n in changed if n not in src.tensors]:
        c = changed.get(name)
        if c is None:
            out.append(copy_tensor(src, name))
        elif isinstance(c, RawTensor):
            qtype, data = int(c.qtype), c.data
            per_row = data.shape[-1] * data.itemsize // row_size(qtype, block_size(qtype))
            out.append(OutTensor(name, qtype, (*data.shape[:-1], per_row * block_size(qtype)),
                                 lambda d=data: d))
        else:
            arr = np.asarray(c, dtype=np.float32)
            qtype = src.qtype(name) if name in src.tensors else 0
            if arr.ndim < 2 and qtype not in (0, 1, 30):  # F32, F16, BF16 store a vector; block types do not
                qtype = 0
            elif arr.ndim >= 2:  # a row length the type's blocks cannot hold: llama-quantize's fallback
                qtype = down_type(qtype, arr.shape[-1])
            out.append(value_tensor(name, qtype, tuple(arr.shape), lambda a=arr: a))
    return out
