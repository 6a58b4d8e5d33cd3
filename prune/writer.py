"""Write a pruned GGUF and quantise it with llama.cpp's own quantiser (no torch).

Tensors the pipeline did not change are copied byte for byte in their stored quantisation, changed
ones are written as float32; `llama_model_quantize` then quantises exactly those (llama.cpp copies a
tensor that already has the type it would choose). Every file appears under its final name only
when complete: it is written under a temporary name in the same folder and renamed.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.errors import ModelLoadFailed
from .errors import OutputExists
from .source import SourceModel
from .stream import A3B_VERSION, copy_kv, add_a3b  # one way to write metadata, shared with streamed writing


class RawTensor:
    """Stored (possibly quantised) bytes of a tensor, written as they are."""

    def __init__(self, data: np.ndarray, qtype):
        self.data = np.ascontiguousarray(data)
        self.qtype = qtype

    @classmethod
    def rows(cls, tensor, rows: np.ndarray) -> RawTensor:
        """A row subset of a GGUF tensor: each row of a matrix is quantised on its own."""
        return cls(np.asarray(tensor.data)[np.asarray(rows)], tensor.tensor_type)


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `final`; rename it to `final` only if the block completes."""
    final = Path(final)
    if final.exists() and not force:
        raise OutputExists(f"{final} already exists; choose another --out or pass --force to replace it.")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.part-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_gguf(src: SourceModel, path: str | os.PathLike, changed: dict[str, np.ndarray | RawTensor], *,
               n_ff: int, a3b: dict[str, Any], n_head: int | None = None) -> None:
    """Write `src` with the `changed` tensors (float32, numpy (out, in) layout), new FFN width and
    query head count (the head size is then written explicitly: llama.cpp derives it from
    n_embd / n_head when the file does not say it)."""
    import gguf

    arch = src.hp.arch
    w = gguf.GGUFWriter(str(path), arch)
    skip = {f"{arch}.feed_forward_length", "general.file_type"}
    skip |= {k for k in src.fields if k.startswith("a3b.")}
    heads_change = n_head is not None and n_head != src.hp.n_head
    if heads_change:
        skip |= {f"{arch}.attention.head_count", f"{arch}.attention.key_length", f"{arch}.attention.value_length"}
    copy_kv(w, src, skip)
    w.add_feed_forward_length(int(n_ff))
    if heads_change:
        w.add_head_count(int(n_head))
        w.add_key_length(int(src.hp.head_dim))
        w.add_value_length(int(src.meta(f"{arch}.attention.value_length", src.hp.head_dim)))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)  # the quantiser sets the real type afterwards
    add_a3b(w, {"version": A3B_VERSION, **a3b})
    names = list(src.tensors) + [n for n in changed if n not in src.tensors]
    for name in names:
        if name in changed and isinstance(changed[name], RawTensor):
            r = changed[name]
            w.add_tensor(name, r.data, raw_shape=r.data.shape, raw_dtype=r.qtype)
        elif name in changed:
            w.add_tensor(name, np.ascontiguousarray(changed[name], dtype=np.float32))
        else:
            t = src.tensors[name]
            w.add_tensor(name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src_path: str | os.PathLike, dst_path: str | os.PathLike, ftype: int | None,
             n_threads: int = 0) -> None:
    """llama.cpp's `llama_model_quantize` to `ftype` (a LLAMA_FTYPE, e.g. 3 = Q4_1); None/0 = float32 copy."""
    from ..runtime.llama import llama

    L = llama()
    params = L.llama_model_quantize_default_params()
    params.nthread = n_threads or os.cpu_count() or 1
    params.ftype = int(ftype or 0)
    params.allow_requantize = False  # unchanged tensors keep their bytes; nothing is quantised twice
    rc = L.llama_model_quantize(str(src_path).encode("utf-8"), str(dst_path).encode("utf-8"),
                                ctypes.byref(params))
    if rc != 0:
        raise ModelLoadFailed(f"llama_model_quantize failed ({rc}) for {src_path} -> ftype {ftype}")
