"""Read a source GGUF for pruning: hyperparameters, raw tensors and dequantised weights (no torch).

The torch reference forward knows architectures whose layers are plain pre-norm attention + SwiGLU
FFN blocks: llama, qwen2 (q/k/v biases) and qwen3 (per-head q/k RMS norms). Streamed pruning with
llama.cpp calibration reads any architecture (`torch_reference=False`); layout.py says which it can
prune. llama.cpp applies rotary
embeddings to adjacent pairs for llama (GGUF conversion permutes q/k accordingly) and to halves
(NeoX style) for qwen2/qwen3; the reference forward follows the same convention.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.models.gguf_info import inspect_gguf, sha256_file
from .errors import UnsupportedArchitecture
from .ggufindex import MetaField, little_endian, read_index
from .layout import TORCH_ARCHITECTURES

ROPE_TYPE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox"}


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    eps: float
    rope_base: float
    rope_type: str
    rope_scale: float
    n_ctx_train: int
    file_type: int | None
    tied_output: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _scalar(v: Any, what: str, path: Path) -> Any:
    """Per-layer array keys: accept a uniform array, refuse a varying one."""
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise UnsupportedArchitecture(f"{path} has per-layer {what} values {sorted(set(v))}; "
                                          "A3B pruning needs the same value in every layer.")
        return v[0]
    return v


class SourceModel:
    """A GGUF opened for reading. `raw(name)` gives the stored bytes, `weight(name)` float32 values.

    `torch_reference`: the file is for the torch reference forward, which knows llama/qwen2/qwen3.
    """

    def __init__(self, path: str | os.PathLike, torch_reference: bool = True):
        self.path = Path(path).resolve()
        info = inspect_gguf(self.path)  # typed errors for missing / foreign / truncated files
        self.info = info
        self.torch_reference = torch_reference
        if torch_reference and info.architecture not in TORCH_ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"the torch reference forward (recovery, sequential a3b, head pruning) knows the "
                f"{', '.join(TORCH_ARCHITECTURES)} architectures; {self.path.name} is {info.architecture!r}. "
                "One-shot pruning calibrated through llama.cpp covers more: --calibration llama --recover-steps 0.")
        # the index read from the map (ggufindex.py: GGUFReader's objects would stay in every run's peak)
        if little_endian(self.path):
            self.data, self.fields, self.tensors = read_index(self.path)
        else:
            from gguf import GGUFReader

            reader = GGUFReader(str(self.path), "r")
            self.data, self.tensors = reader.data, {t.name: t for t in reader.tensors}
            self.fields = {k: MetaField(list(f.types), f.contents()) for k, f in reader.fields.items()}
        arch = info.architecture

        def key(suffix: str, default: Any = None) -> Any:
            f = self.fields.get(f"{arch}.{suffix}")
            if f is None:
                return default
            v = f.contents()
            return _scalar(v, suffix, self.path)

        def lenient(suffix: str, default: Any) -> Any:  # per-layer arrays are fine where torch is not used
            if torch_reference:
                return key(suffix, default)
            f = self.fields.get(f"{arch}.{suffix}")
            v = default if f is None else f.contents()
            return max(v) if isinstance(v, list) and v else v

        n_embd = int(key("embedding_length"))
        n_head = int(lenient("attention.head_count", 1) or 1)
        head_dim = int(lenient("attention.key_length", n_embd // n_head))
        scaling = key("rope.scaling.type", "none") if torch_reference else "none"
        if scaling not in ("none", "linear"):
            raise UnsupportedArchitecture(f"{self.path.name} uses RoPE scaling {scaling!r}; the reference "
                                          "forward supports none and linear.")
        emb = self.tensors["token_embd.weight"]
        self.hp = HParams(
            arch=arch, n_layer=int(key("block_count")), n_embd=n_embd, n_ff=int(lenient("feed_forward_length", 0)),
            n_head=n_head, n_head_kv=int(lenient("attention.head_count_kv", n_head) or n_head), head_dim=head_dim,
            n_vocab=int(emb.shape[1]), eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base=float(key("rope.freq_base", 10000.0)), rope_type=ROPE_TYPE.get(arch, "neox"),
            rope_scale=1.0 / float(key("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
            n_ctx_train=int(key("context_length", 2048)),
            file_type=self.fields["general.file_type"].contents() if "general.file_type" in self.fields else None,
            tied_output="output.weight" not in self.tensors)
        for i in range(self.hp.n_layer if torch_reference else 0):
            for part in ("ffn_gate", "ffn_up", "ffn_down"):
                if f"blk.{i}.{part}.weight" not in self.tensors:
                    raise UnsupportedArchitecture(f"{self.path.name} has no blk.{i}.{part}.weight: A3B pruning "
                                                  "needs gated (SwiGLU) FFN blocks in every layer.")

    @cached_property
    def sha256(self) -> str:
        return sha256_file(self.path)

    def raw(self, name: str):
        return self.tensors[name]

    def stored(self, name: str) -> np.ndarray:
        """The stored bytes (or values, for float types) of a tensor: a view of the memory-mapped file."""
        return np.asarray(self.tensors[name].data)

    def release(self, name: str) -> None:
        """Drop a tensor's pages from this process's map of the file, once it is no longer needed (the
        writer calls this after each tensor). Pages read through the map count in the process's
        resident size until it lets go of them, so writing the whole file through the map would add the
        file's size to the peak; a later read maps them again, from the page cache."""
        t = self.tensors.get(name)
        mm = getattr(self.data, "_mmap", None)
        if t is None or mm is None or not hasattr(mm, "madvise"):
            return
        start = int(t.data_offset) - int(t.data_offset) % mmap.PAGESIZE
        end = min(int(t.data_offset) + int(t.n_bytes), len(mm))
        # whole pages only: a page shared with the next tensor is dropped too and simply read again
        length = -(-(end - start) // mmap.PAGESIZE) * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, min(length, len(mm) - start))
        except (OSError, ValueError):  # an advice the system refuses only leaves the pages resident
            pass

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's numpy shape, rows first (GGUF's ne reversed)."""
        return tuple(int(x) for x in reversed(self.tensors[name].shape))

    def qtype(self, name: str) -> int:
        """A tensor's ggml type (GGMLQuantizationType value)."""
        return int(self.tensors[name].tensor_type)

    def release_all(self) -> None:
        """Drop every tensor's pages from this process's map of the file (see `release`)."""
        for name in self.tensors:
            self.release(name)

    def weight(self, name: str, release: bool = False) -> np.ndarray:
        """Dequantised float32 values, numpy row-major: (rows, cols) = (out, in) for matrices (a copy:
        `release` then drops the stored bytes' pages from the map, see `release`)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        if t.tensor_type == GGMLQuantizationType.F32:
            a = np.array(t.data, dtype=np.float32)
        else:
            a = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)
        if release:
            self.release(name)
        shape = tuple(int(x) for x in reversed(t.shape))
        return a.reshape(shape)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def meta(self, name: str, default: Any = None) -> Any:
        f = self.fields.get(name)
        return default if f is None else f.contents()
