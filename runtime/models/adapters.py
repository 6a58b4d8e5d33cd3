"""GGUF LoRA adapters: what their metadata says, and whether one was made for a given base file.

llama.cpp loads an adapter over any base of the same architecture whose tensors have the shapes the
adapter expects: a LoRA trained for another fine-tune or quantisation of the same shape loads
without a word and computes nonsense. An adapter `a3b tune` wrote records the SHA-256 of the exact
base file it was trained on (`a3b.base.sha256`); `check` refuses it on any other file, before
llama.cpp sees it. Adapters from elsewhere (no a3b keys) are checked for what llama.cpp itself
needs (general.type, adapter.type, the architecture) so the error names the problem.

Before that, the header is walked with every size bounded (ggufscan.scan_header: a cut file or a
count of 2**40 keys is a one-line error) and every key llama.cpp reads is checked for its type
(KEY_TYPES: llama.cpp reads `adapter.lora.alpha` as a float32 and aborts the process on a string).
What no check here can foresee is found by loading the adapter over its base in a child process
first (vet.check_adapter), as for models and projectors.

The base's digest is computed once per (path, size, modification time) in this process.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from ..errors import CorruptGGUF, InvalidRequest, ModelNotFound, NotGGUF
from .ggufscan import ARRAY, FLOAT32, STRING, UINT32, HeaderScan, type_name

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


#: the adapter keys llama.cpp reads, with the one GGUF value type each must have: libllama reads the
#: strings with gguf_get_val_str and alpha with gguf_get_val_f32, which assert (abort the process)
#: on any other type (llama-adapter.cpp; the task name and prompt prefix are read as strings by
#: llama.cpp's tools); (ARRAY, UINT32): an array of uint32
KEY_TYPES = {"general.type": (STRING, None), "general.architecture": (STRING, None), "adapter.type": (STRING, None),
             "adapter.lora.alpha": (FLOAT32, None), "adapter.lora.task_name": (STRING, None),
             "adapter.lora.prompt_prefix": (STRING, None), "adapter.alora.invocation_tokens": (ARRAY, UINT32),
             "general.alignment": (UINT32, None)}
#: what an adapter's tensor names end with (llama.cpp refuses any other)
SUFFIXES = (".lora_a", ".lora_b")


def scan(path: str | os.PathLike) -> HeaderScan:
    """The adapter's header, every size bounded (a cut file or an absurd count is a typed error in one
    line), and every key llama.cpp reads checked for its type."""
    from .ggufscan import scan_header

    p = Path(path)
    if not p.is_file():
        raise ModelNotFound(f"LoRA adapter not found: {p}")
    try:
        header = scan_header(p)
    except NotGGUF as e:
        raise AdapterMismatch(f"{p.name} is not a GGUF LoRA adapter: {e}") from None
    for key, want in KEY_TYPES.items():
        got = header.types.get(key)
        if got is not None and got != want:
            raise CorruptGGUF(f"{p.name} is not a valid LoRA adapter: {key} is stored as {type_name(*got)}, not "
                              f"{type_name(*want)} (llama.cpp would abort the process on it). The file is damaged or "
                              "was written by a broken converter; convert or tune it again.")
    return header


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The adapter's metadata keys and values (the header only; tensors are not read). Arrays longer
    than ggufscan's kept length are left out."""
    return dict(scan(path).metadata)


def _check_tensors(a: Path, header: HeaderScan, base: Path) -> None:
    """Each pair's trailing dimensions are the base tensor's (llama.cpp checks the first two and
    multiplies with the rest, asserting on a mismatch in the middle of a decode)."""
    from .ggufscan import scan_header

    shapes = {name: shape for name, shape, _, _ in scan_header(base).tensors}
    for name, shape, _, _ in header.tensors:
        stem = next((name[:-len(s)] for s in SUFFIXES if name.endswith(s)), None)
        if stem is None or stem not in shapes:
            continue   # llama.cpp refuses these itself, with its own words
        if len(shape) < 2 or tuple(shape[2:]) != tuple(shapes[stem][2:]):
            raise AdapterMismatch(f"{a.name}: tensor {name!r} has the shape {list(shape)}, which does not fit "
                                  f"{stem!r} of {base.name} ({list(shapes[stem])}).")


def check(adapter: str | os.PathLike, base: str | os.PathLike) -> dict[str, Any]:
    """The adapter's metadata, or AdapterMismatch when it is not an adapter for the file `base`."""
    a, b = Path(adapter).resolve(), Path(base).resolve()
    if not a.is_file():
        raise ModelNotFound(f"LoRA adapter not found: {a}")
    key = (_stamp(a), _stamp(b))
    with _lock:
        if key in _verdicts:
            return _verdicts[key]
    header = scan(a)
    meta = dict(header.metadata)
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
    _check_tensors(a, header, b)
    with _lock:
        _verdicts[key] = meta
    return meta
