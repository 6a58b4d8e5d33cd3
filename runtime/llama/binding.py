"""The ctypes binding: llama-cpp-python imported once, llama.cpp's log captured, batches filled.

llama-cpp-python's public low-level API mirrors llama.h function by function; the runtime uses it
directly instead of `llama_cpp.Llama`, which owns its model (a second `Llama` for embeddings would
load the file a second time). llama.cpp reports load errors only as log lines next to a NULL, so
its log is routed into `logging` and the recent lines are kept for the error classifier.
"""
from __future__ import annotations

import collections
import ctypes
import importlib.util
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import LlamaCppUnavailable
from . import cxxruntime

log = logging.getLogger("a3b.llama")

_lib = None
#: Serialises calls that llama.cpp does not make thread-safe across models (model loading).
lib_lock = threading.Lock()
#: (seq, level, text); room for one load's lines: a placement override logs one line per tensor it
#: places (144 for a 48-layer model's experts), which placement.measured_from_log counts
_recent_log: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=4000)
_log_seq = 0
_log_cb = None  # keep a reference: llama.cpp holds the pointer

#: ggml type ids of the KV cache types in options.KV_CACHE_TYPES
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


def llama():
    """Import llama_cpp once, initialise the backend and route llama.cpp's log into `logging`."""
    global _lib, _log_cb
    if _lib is not None:
        return _lib
    with lib_lock:
        if _lib is not None:
            return _lib
        cxxruntime.note_order()
        try:
            import llama_cpp
        except Exception as e:  # ImportError, or OSError from a broken shared library
            raise LlamaCppUnavailable(
                f"llama-cpp-python is not usable ({type(e).__name__}: {e}). Install it with "
                "'pip install llama-cpp-python' (CPU) or see the README for a CUDA/Metal build."
            ) from e
        problem = cxxruntime.clash()
        if problem:
            raise LlamaCppUnavailable(problem)

        @llama_cpp.llama_log_callback
        def _cb(level: int, text: bytes, user_data):  # called from C, with the GIL
            global _log_seq
            s = text.decode("utf-8", "replace")
            _log_seq += 1
            _recent_log.append((_log_seq, level, s))
            log.debug("llama.cpp: %s", s.rstrip())

        _log_cb = _cb
        llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _lib = llama_cpp
        return _lib


def check_usable() -> None:
    """Load llama.cpp now; LlamaCppUnavailable (with what to do) where it is missing or broken."""
    llama()


def library_dir() -> Path | None:
    """The folder of the shared libraries llama-cpp-python loads (libllama, libggml*), found without
    importing it: LLAMA_CPP_LIB_PATH where set (llama-cpp-python loads its libllama from there: a
    llama.cpp built apart), else the package's own; None where it is not installed."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent / "lib"


def log_mark() -> int:
    """A position in llama.cpp's log; `log_since(mark)` returns what it wrote after it."""
    return _log_seq


def log_since(mark: int) -> str:
    return "".join(s for seq, _, s in list(_recent_log) if seq > mark)


def llama_cpp_version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("llama-cpp-python")
    except Exception:  # noqa: BLE001 - only a label in status reports, which must never fail
        return "unknown"


def system_info() -> dict[str, Any]:
    L = llama()
    return {
        "llama_cpp_python": llama_cpp_version(),
        "system_info": L.llama_print_system_info().decode("utf-8", "replace").strip(),
        "gpu_offload": bool(L.llama_supports_gpu_offload()),
        "mmap": bool(L.llama_supports_mmap()),
        "mlock": bool(L.llama_supports_mlock()),
    }


def fill_batch(batch, items: Iterable[tuple[int, int, int, bool]]) -> int:
    """Write (token, position, sequence id, wants logits) items into a `llama_batch`; return the count.

    The one place a batch is filled by hand (generation steps, embedding packs, prompt-speed
    measurement, the pruning tool's evaluator). The batch must have room for every item.
    """
    n = 0
    for token, pos, seq_id, logits in items:
        batch.token[n] = token
        batch.pos[n] = pos
        batch.n_seq_id[n] = 1
        batch.seq_id[n][0] = seq_id
        batch.logits[n] = bool(logits)
        n += 1
    batch.n_tokens = n
    return n


def sequence(tokens: list[int], start: int = 0, seq_id: int = 0, all_logits: bool = False):
    """Batch items for one sequence's tokens from position `start`; logits for the last one (or all)."""
    last = len(tokens) - 1
    return ((t, start + i, seq_id, all_logits or i == last) for i, t in enumerate(tokens))
