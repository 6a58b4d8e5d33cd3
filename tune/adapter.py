"""The trained LoRA as a GGUF adapter that stock llama.cpp loads (`llama_adapter_lora_init`).

The layout follows llama.cpp's convert_lora_to_gguf.py: general.type "adapter", adapter.type "lora",
adapter.lora.alpha, general.architecture the base's, and for each adapted base tensor
`blk.N.<name>.weight` the pair `blk.N.<name>.weight.lora_a` with ggml shape [n_in, rank] (torch
(rank, n_in)) and `.lora_b` with ggml shape [rank, n_out] (torch (n_out, rank)); llama.cpp checks
exactly these shapes against the base tensor and reads the rank from lora_b. Tensors are float32.

Beside them, a3b keys (runtime/models/adapters.py names them): the base file's SHA-256 and name (the
runtime refuses the adapter over any other file), the repository's path and commit, the split
(seed, files held out), the held-out loss of the base and of the adapter, and the training options.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.models import adapters as keys
from .errors import InvalidRequest


def write(path: str | os.PathLike, arch: str, alpha: float, tensors: dict[str, tuple[np.ndarray, np.ndarray]],
          meta: dict[str, Any]) -> Path:
    """Write the adapter; `tensors`: base tensor name -> (A (r, in), B (out, r)); `meta`: a3b keys."""
    from gguf import GGUFWriter

    out = Path(path)
    tmp = out.with_name(out.name + ".part")
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()   # a stale part, or a link in its place: written anew, never through
    except OSError as e:
        raise InvalidRequest(f"cannot write the adapter beside {out}: {tmp} is in the way ({e.strerror or e}).") from e
    try:
        w = GGUFWriter(str(tmp), arch)
    except OSError as e:
        raise InvalidRequest(f"cannot write the adapter to {out}: {e.strerror or e}. Choose another --out.") from e
    try:
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", float(alpha))
        w.add_name(str(meta.get(keys.BASE_NAME, "a3b")) + " LoRA")
        for k, v in meta.items():
            if isinstance(v, bool):
                w.add_bool(k, v)
            elif isinstance(v, int):
                w.add_uint64(k, v)
            elif isinstance(v, float):
                w.add_float64(k, v)
            elif isinstance(v, str):
                w.add_string(k, v)
            else:
                w.add_string(k, json.dumps(v, sort_keys=True))
        for name in sorted(tensors, key=_order):
            a, b = tensors[name]
            w.add_tensor(name + ".lora_a", np.ascontiguousarray(a, dtype=np.float32))
            w.add_tensor(name + ".lora_b", np.ascontiguousarray(b, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    if out.is_symlink() or (out.exists() and not out.is_file()):   # changed while training
        tmp.unlink()
        raise InvalidRequest(f"--out {out} became a link or a non-file while training; the adapter was not written.")
    os.replace(tmp, out)
    return out


def _order(name: str) -> tuple:
    parts = name.split(".")
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1, name)


def read(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(metadata, base tensor name -> (A, B)) of an adapter, as `write` takes them."""
    from gguf import GGUFReader

    meta = keys.read_meta(path)   # first: a cut or crafted header is a typed error, not a reader's traceback
    reader = GGUFReader(str(path), "r")
    parts: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        base, _, which = t.name.rpartition(".")
        shape = tuple(int(x) for x in reversed(t.shape))
        parts.setdefault(base, {})[which] = np.array(t.data, dtype=np.float32).reshape(shape)
    return meta, {k: (v["lora_a"], v["lora_b"]) for k, v in parts.items()}


def check_writable(path: str | os.PathLike) -> Path:
    """Refuse an output path that cannot be written, before any training (by creating a file beside it)."""
    given = Path(path).expanduser()
    if given.is_symlink():
        raise InvalidRequest(f"--out {given} is a link; give the adapter's own path (a link's target is not replaced).")
    out = given.resolve()
    if out.exists() and not out.is_file() and not out.is_dir():
        raise InvalidRequest(f"--out {out} exists and is not a regular file (a device, a pipe or a socket); give "
                             "the path of a new or an existing adapter file.")
    parent = out.parent
    if not parent.is_dir():
        raise InvalidRequest(f"--out {out}: the folder {parent} does not exist.")
    if out.is_dir():
        raise InvalidRequest(f"--out {out} is a folder; give the adapter's file name.")
    probe = out.with_name(f".{out.name}.probe-{os.getpid()}")
    try:
        probe.open("xb").close()
        probe.unlink()
        if out.exists() and not os.access(out, os.W_OK):
            raise PermissionError(13, "the file is read-only")
    except OSError as e:
        raise InvalidRequest(f"--out {out}: not writable ({e.strerror or e}). Choose a path in a folder you can "
                             "write to.") from e
    return out
