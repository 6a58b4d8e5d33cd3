"""Giving freed memory back to the operating system.

Model contexts, batches and per-request buffers are large allocations made and freed from several
threads. glibc's allocator keeps freed memory in per-thread arenas and rarely returns it, so a
process that loads, unloads and serves for hours shows a resident size that only grows (measured
with bench_soak: +45% over 10 minutes of editors, a workflow loop and unloads, with Python's own
objects flat). Two measures, on glibc only (elsewhere, macOS, Windows, musl, they do nothing):

* `tune_allocator()`, once when the first model loads: a fixed mmap threshold of 1 MiB
  (`mallopt(M_MMAP_THRESHOLD)`). glibc otherwise raises that threshold each time a large block is
  freed, after which the contexts, batches and logits buffers of the next load come from the heap
  and fragment it. With the fixed threshold they are mapped and unmapped whole. In bench_soak the
  resident size then stopped creeping (median of the last third of a 5-minute run below the first
  third's, against +10% to +30% without). `A3B_MALLOC_TUNING=off` leaves the allocator alone.
* `release()`: `malloc_trim(0)` returns the free pages of every arena (0.1-5 ms). It is called after
  an unload, when a model's worker falls idle (at most every MIN_INTERVAL_S), and every
  BUSY_INTERVAL_S while it never does.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

MIN_INTERVAL_S = 5.0
BUSY_INTERVAL_S = 30.0

_lock = threading.Lock()
_last = 0.0
_trim = None
_looked = False
_tuned = False
M_MMAP_THRESHOLD = -3     # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None  # glibc only
    except (OSError, AttributeError):
        return None


def _malloc_trim():
    global _trim, _looked
    if not _looked:
        _looked = True
        libc = _libc()
        if libc is not None:
            _trim = libc.malloc_trim
            _trim.argtypes = [ctypes.c_size_t]
            _trim.restype = ctypes.c_int
    return _trim


def tune_allocator() -> bool:
    """Fix glibc's mmap threshold at 1 MiB (once per process); False when not done."""
    global _tuned
    if _tuned:
        return True
    _tuned = True
    from ..environment import env_on

    if not env_on("A3B_MALLOC_TUNING"):
        return False
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def release(force: bool = False, busy: bool = False) -> bool:
    """Return free heap memory to the OS (glibc); False when skipped (too soon, or not glibc).
    `busy`: called between steps of work, so only every BUSY_INTERVAL_S."""
    global _last
    trim = _malloc_trim()
    if trim is None:
        return False
    with _lock:
        now = time.monotonic()
        if not force and now - _last < (BUSY_INTERVAL_S if busy else MIN_INTERVAL_S):
            return False
        _last = now
    trim(0)
    return True
