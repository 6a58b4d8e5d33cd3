"""GGUF LoRA adapters: what their metadata says, and whether one was made for a given base file.

llama.cpp loads an adapter over any base of the same architecture whose tensors have the shapes the
adapter expects: a LoRA trained for another fine-tune or quantisation of the same shape loads
without a word and computes nonsense. An adapter `a3b tune` wrote records the SHA-256 of the exact
base file it was trained on (`a3b.base.sha256`); `check` refuses it on any other file, before
llama.cpp sees it. Adapters from elsewhere (no a3b keys) are checked for what llama.cpp itself
needs (general.type, adapter.type, the architecture) so the error names the problem.

The base's digest is computed once per (path, size, modification time) in this process.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from .errors import InvalidRequest, ModelNotFound

#: the keys `a3b tune` writes (tune/adapter.py), read here
BASE_SHA256 = "a3b.base.sha256"
BASE_NAME = "a3b.base.name"
REPO = "a3b.tune.repo"
COMMIT = "a3b.tune.commit"
SPLIT = "a3b.tune.split"
HELDOUT_BASE = "a3b.tune.heldout_loss_base"
HELDOUT = "a3b.tune.heldout_loss"
CONFIG = "a3b.tune.config"

_lock = threading.Lock()
_digests: dict[tuple, str] = {}
_verdicts: dict[tuple, dict[str, Any]] = {}


class AdapterMismatch(InvalidRequest):
    """An adapter made for another base model (or not a LoRA adapter at all)."""

    code = "adapter_mismatch"


def _stamp(p: Path) -> tuple:
    st = p.stat()
    return (str(p), st.st_size, st.st_mtime_ns)


def base_digest(path: str | os.PathLike) -> str:
    """The SHA-256 of a base file, once per (path, size, mtime)."""
    from .gguf_info import sha256_file

    p = Path(path).resolve()
    key = _stamp(p)
    with _lock:
        hit = _digests.get(key)
    if hit is None:
        hit = sha256_file(p)
        with _lock:
            _digests[key] = hit
    return hit


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The adapter's metadata keys and values (the header only; tensors are not read)."""
    from gguf import GGUFReader

    from .gguf_info import _field_value

    p = Path(path)
    if not p.is_file():
        raise ModelNotFound(f"LoRA adapter not found: {p}")
    try:
        reader = GGUFReader(str(p), "r")
    except (ValueError, OSError) as e:
        raise AdapterMismatch(f"{p.name} is not a GGUF LoRA adapter: {e}") from e
    return {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def check(adapter: str | os.PathLike, base: str | os.PathLike) -> dict[str, Any]:
    """The adapter's metadata, or AdapterMismatch when it is not an adapter for the file `base`."""
    a, b = Path(adapter).resolve(), Path(base).resolve()
    if not a.is_file():
        raise ModelNotFound(f"LoRA adapter not found: {a}")
    key = (_stamp(a), _stamp(b))
    with _lock:
        if key in _verdicts:
            return _verdicts[key]
    meta = read_meta(a)
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterMismatch(f"{a.name} is not a LoRA adapter (general.type={meta.get('general.type')!r}, "
                              f"adapter.type={meta.get('adapter.type')!r}).")
    from .gguf_info import inspect_gguf

    arch = inspect_gguf(b).architecture
    if meta.get("general.architecture") != arch:
        raise AdapterMismatch(f"{a.name} is an adapter for a {meta.get('general.architecture')!r} model; "
                              f"{b.name} is {arch!r}. Use the base it was trained for, or tune one for this model "
                              "(a3b tune DIR --model ...).")
    want = meta.get(BASE_SHA256)
    if want and base_digest(b) != want:
        name = meta.get(BASE_NAME) or "another file"
        raise AdapterMismatch(f"{a.name} was trained for {name} (sha256 {str(want)[:12]}...), not for {b.name}: "
                              "its update only means something over that exact base. Load it over that file, "
                              "or tune an adapter for this one (a3b tune DIR --model ...).")
    with _lock:
        _verdicts[key] = meta
    return meta
