"""llama.cpp's quantiser: rows of float values to a ggml type, and a whole GGUF to a file type.

`quantize_rows` calls `ggml_quantize_chunk`, the function `llama_model_quantize` itself calls per
tensor, so a tensor quantised here holds the bytes llama-quantize would have written for it.
`quantize_file` is `llama_model_quantize` (the pruning tool's float-file path, the tests, and the
serving copies of reencode.py).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from ..environment import usable_cpus
from ..errors import ModelLoadFailed
from .binding import llama
from .ggml import block_size, lib, qtype_name, row_size


def quantize_rows(values: np.ndarray, qtype: int, imatrix: np.ndarray | None = None,
                  n_threads: int = 0) -> np.ndarray:
    """Quantise a (rows, n) float32 matrix to ggml type `qtype` with llama.cpp's quantiser.

    Returns the stored bytes, (rows, row_size) uint8. `imatrix` (n,), the mean squared input of each
    column, weights the rounding error as llama-quantize's importance matrix does; types that need
    one (the IQ1/IQ2 family) refuse to quantise without it.
    """
    L = lib()
    x = np.ascontiguousarray(values, dtype=np.float32)
    rows, n = x.shape
    bs = block_size(qtype)
    if n % bs:
        raise ValueError(f"rows of {n} values cannot be stored in ggml type {qtype_name(qtype)} "
                         f"(blocks of {bs})")
    if imatrix is None and L.ggml_quantize_requires_imatrix(int(qtype)):
        raise ValueError(f"ggml type {qtype_name(qtype)} needs an importance matrix to quantise")
    rs = row_size(qtype, n)
    out = np.empty((rows, rs), dtype=np.uint8)
    im = None
    if imatrix is not None:
        im = np.ascontiguousarray(imatrix, dtype=np.float32)
        if im.shape != (n,):
            raise ValueError(f"importance matrix of shape {im.shape} for rows of {n}")
    # the quantiser is row-independent and releases the GIL (a ctypes call): chunks of rows in
    # threads, as llama_model_quantize does; a few MB per call at most
    threads = max(1, min(n_threads or usable_cpus(), 16))
    chunk = max(1, min((1 << 24) // max(1, n), -(-rows // (2 * threads))))

    def one(r0: int) -> None:
        r1 = min(rows, r0 + chunk)
        written = L.ggml_quantize_chunk(int(qtype), x[r0:r1].ctypes.data, out[r0:r1].ctypes.data, 0, r1 - r0, n,
                                        im.ctypes.data if im is not None else None)
        if written != (r1 - r0) * rs:
            raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {(r1 - r0) * rs}")

    starts = range(0, rows, chunk)
    if threads == 1 or len(starts) == 1:
        for r0 in starts:
            one(r0)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(one, r0) for r0 in starts]:
                f.result()
    return out


def quantize_file(src_path: str | os.PathLike, dst_path: str | os.PathLike, ftype: int | None, *,
                  requantize: bool = False, n_threads: int = 0) -> None:
    """`llama_model_quantize` to `ftype` (a LLAMA_FTYPE, e.g. 3 = Q4_1, 7 = Q8_0; None/0 = float32).

    `requantize` False: tensors already quantised keep their bytes (nothing is quantised twice);
    True: they are dequantised and quantised again (a re-encoded copy in another type).
    """
    L = llama()
    params = L.llama_model_quantize_default_params()
    params.nthread = n_threads or usable_cpus()
    params.ftype = int(ftype or 0)
    params.allow_requantize = bool(requantize)
    rc = L.llama_model_quantize(str(src_path).encode("utf-8"), str(dst_path).encode("utf-8"), ctypes.byref(params))
    if rc != 0:
        raise ModelLoadFailed(f"llama.cpp could not quantise {os.fspath(src_path)} to file type {ftype} (code {rc}).")
