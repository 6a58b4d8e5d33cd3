"""Stopping a running llama_decode from another thread: llama.cpp's abort callback, with no Python in it.

llama.cpp's CPU backend asks its abort callback after every graph node (`ggml_abort_callback`,
`bool (*)(void * data)`), and a decode it stops returns 2 with that micro-batch's cells removed.
A Python callback there would run a thousand times per pass and take the GIL each time, so the
callback is C's own `strlen` over a two-byte buffer: the empty string (false) while running, one
character (true) once `set()` was called. That costs nanoseconds per node, from any thread. A GPU
backend does not ask the callback: there the running micro-batch finishes (tens of milliseconds).
Without a C library to find, `flag()` is None and nothing stops a decode early.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

from .binding import llama


def _strlen():
    try:
        libc = ctypes.CDLL(None) if sys.platform != "win32" else ctypes.cdll.msvcrt
        return ctypes.cast(libc.strlen, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


class AbortFlag:
    def __init__(self, address: int):
        self._buf = ctypes.create_string_buffer(2)   # kept alive with the context it is attached to
        self._callback = llama().ggml_abort_callback(address)

    def attach(self, ctx) -> None:
        llama().llama_set_abort_callback(ctx, self._callback, ctypes.addressof(self._buf))

    def set(self) -> None:
        self._buf[0] = b"x"

    def clear(self) -> None:
        self._buf[0] = b"\0"

    @property
    def is_set(self) -> bool:
        return self._buf[0] != b"\0"


def flag() -> AbortFlag | None:
    address = _strlen()
    return AbortFlag(address) if address else None
