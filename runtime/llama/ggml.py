"""The few ggml functions that llama-cpp-python does not bind, bound with ctypes from its libggml-base.

- Graph evaluation callback (graph.py): `ggml_tensor` (the struct, read-only), `ggml_op_name`,
  `ggml_nbytes`, `ggml_backend_buffer_is_host` and `ggml_backend_tensor_get` (a tensor computed on a
  GPU is copied to host memory before it is read).
- Quantisation (quantize.py): `ggml_quantize_chunk` (llama.cpp's own quantiser, the one
  `llama_model_quantize` calls), `ggml_row_size`, `ggml_blck_size`, `ggml_quantize_requires_imatrix`.

The struct layout is ggml's public `struct ggml_tensor` (ggml.h) for the vendored ggml of
llama-cpp-python 0.3.x; `tensor_view` checks it on every call that matters (name terminated,
dimensions positive) so a layout change fails loudly instead of reading garbage.
"""
from __future__ import annotations

import ctypes
from functools import cache, lru_cache

import numpy as np

from .binding import library_dir, llama

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64


class GGMLTensor(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


TensorPtr = ctypes.POINTER(GGMLTensor)

#: typedef bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t, bool ask, void * user_data);
EVAL_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)


@lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    """libggml-base of the installed llama-cpp-python (the copy llama.cpp itself uses)."""
    llama()  # load libllama first, so that this resolves to the library already in the process
    d = library_dir()
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        if (d / name).exists():
            L = ctypes.CDLL(str(d / name))
            break
    else:
        raise OSError(f"libggml-base not found in {d}")
    sig = {
        "ggml_op_name": (ctypes.c_char_p, [ctypes.c_int]),
        "ggml_type_name": (ctypes.c_char_p, [ctypes.c_int]),
        "ggml_nbytes": (ctypes.c_size_t, [ctypes.c_void_p]),
        "ggml_backend_buffer_is_host": (ctypes.c_bool, [ctypes.c_void_p]),
        "ggml_backend_tensor_get": (None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
        "ggml_row_size": (ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]),
        "ggml_blck_size": (ctypes.c_int64, [ctypes.c_int]),
        "ggml_quantize_requires_imatrix": (ctypes.c_bool, [ctypes.c_int]),
        "ggml_quantize_chunk": (ctypes.c_size_t, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]),
    }
    for fn, (res, args) in sig.items():
        f = getattr(L, fn)
        f.restype, f.argtypes = res, args
    return L


@cache
def op_name(op: int) -> str:
    return lib().ggml_op_name(op).decode()


class TensorView:
    """What a callback needs of one ggml tensor: name, op, shape, type, sources, data on the host."""

    __slots__ = ("ptr", "t")

    def __init__(self, ptr: int):
        self.ptr = ptr
        self.t = ctypes.cast(ptr, TensorPtr).contents

    @property
    def name(self) -> str:
        return bytes(self.t.name).split(b"\0", 1)[0].decode("utf-8", "replace")

    @property
    def op(self) -> str:
        return op_name(self.t.op)

    @property
    def type(self) -> int:
        return int(self.t.type)

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.t.ne)

    def src(self, i: int) -> TensorView | None:
        p = self.t.src[i]
        return TensorView(p) if p else None

    def numpy(self) -> np.ndarray:
        """The data as a numpy array of shape (ne3, ne2, ne1, ne0), copied to host memory.

        F32, F16, I32 (a MUL_MAT_ID node's chosen experts), I8/I16/I64 and F64 tensors; views with
        strides (a slice of a larger tensor) are read through their strides. Quantised tensors
        (weights) are not activations and are refused.
        """
        t = self.t
        dtype = _NUMPY_TYPES.get(int(t.type))
        if dtype is None:
            raise TypeError(f"tensor {self.name} has ggml type {t.type}, not one of F32/F16/I32/I8/I16/I64/F64")
        ne = self.ne
        if any(n <= 0 for n in ne):
            raise ValueError(f"tensor {self.name} has shape {ne}: the ggml_tensor layout does not match")
        item = np.dtype(dtype).itemsize
        nb = tuple(int(x) for x in t.nb)
        if nb[0] != item:
            raise ValueError(f"tensor {self.name} has element stride {nb[0]}: the ggml_tensor layout does not match")
        span = item + sum((n - 1) * b for n, b in zip(ne, nb))  # bytes from the first to the last element
        L = lib()
        raw = np.empty(span, dtype=np.uint8)
        if t.buffer and not L.ggml_backend_buffer_is_host(t.buffer):
            L.ggml_backend_tensor_get(self.ptr, raw.ctypes.data, 0, span)
        else:
            ctypes.memmove(raw.ctypes.data, t.data, span)
        if nb == _contiguous(ne, item):
            return raw.view(dtype).reshape(ne[::-1])
        # a strided view: gather its elements (as bytes), then reinterpret
        view = np.lib.stride_tricks.as_strided(raw, shape=(*ne[::-1], item), strides=(*nb[::-1], 1))
        return np.ascontiguousarray(view).view(dtype).reshape(ne[::-1])


#: ggml type -> numpy dtype of the activations and indices a callback reads
_NUMPY_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


def _contiguous(ne: tuple[int, ...], item: int) -> tuple[int, ...]:
    nb = [item]
    for n in ne[:-1]:
        nb.append(nb[-1] * n)
    return tuple(nb)


def row_size(qtype: int, n: int) -> int:
    return int(lib().ggml_row_size(int(qtype), int(n)))


def block_size(qtype: int) -> int:
    return int(lib().ggml_blck_size(int(qtype)))


def qtype_name(qtype: int) -> str:
    return lib().ggml_type_name(int(qtype)).decode()
