"""Reading a GGUF's header safely (no llama.cpp, no `gguf` reader).

* `scan_header` walks the header, the metadata and the tensor index with every count and length
  checked against the file's size before anything is allocated. It keeps only small values (no
  vocabulary arrays) and is cheap even for multi-GB files and 262k-token vocabularies. A crafted
  file (a string type changed to an array whose "length" is eight random bytes, say) gets a
  `CorruptGGUF` error here instead of sending a reader after gigabytes that are not there.
  Every tensor's data must lie inside the file, so sizes computed from the shapes are bounded too.
* `Dims` are the hyperparameters the runtime reads from the scan before llama.cpp has accepted the
  file (the layer planner, the main-memory check): each is checked against a bound, so a crafted
  `block_count` of 2**32 - 1 is a `CorruptGGUF` naming the key, not a list of four billion layers.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CorruptGGUF, ModelNotFound, NotGGUF, TruncatedGGUF

GGUF_MAGIC = b"GGUF"


def check_header(path: str | os.PathLike) -> None:
    """Raise ModelNotFound / NotGGUF unless `path` is a readable file starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        raise ModelNotFound(f"Model file not found: {p}. Check the path, or put the .gguf file in "
                            "ComfyUI's models/LLM folder or in $A3B_MODELS.")
    with open(p, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise NotGGUF(f"{p} is not a GGUF file (first bytes {head!r}, expected b'GGUF'). "
                      "Convert it with llama.cpp's convert_hf_to_gguf.py, or pick a .gguf file.")


# GGUF value types: size in bytes of a scalar (None: a string or an array)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
UINT32, FLOAT32 = 4, 6
#: GGUF value types by number, as llama.cpp names them (gguf_type_name)
TYPE_NAMES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool", 8: "str", 9: "arr",
              10: "u64", 11: "i64", 12: "f64"}


def type_name(vtype: int, etype: int | None = None) -> str:
    """A GGUF value type in words: `u32`, `str`, `arr[u32]`."""
    name = TYPE_NAMES.get(vtype, f"type {vtype}")
    return f"{name}[{TYPE_NAMES.get(etype, f'type {etype}')}]" if vtype == ARRAY else name
MAX_KEY_BYTES = 1 << 16
MAX_DIMS = 4            # GGML_MAX_DIMS
#: a size beyond this cannot be a cut-off file, only a damaged field
PLAUSIBLE_BYTES = 1 << 40
#: metadata keys whose value must be a string for llama.cpp (and for us)
_STRING_KEYS = ("general.architecture",)
#: llama.cpp's LLAMA_MAX_LAYERS (llama-hparams.h): its loader aborts on more layers
MAX_LAYERS = 512
#: arrays kept by scan_header (small ones: strings up to 64, numbers up to one per layer); larger
#: arrays are checked and skipped
_KEEP_ARRAY_LEN = 64
#: an `a3b.*` array (the pruning record: per-layer widths, calibration topics) is kept up to this
_KEEP_A3B_LEN = 4096
_KEEP_NUMBERS_LEN = MAX_LAYERS
#: Bounds of the hyperparameters read before llama.cpp has accepted a file (`dims`). llama.cpp
#: checks these values itself, or aborts on them (runtime/models/vet.py); the bounds only keep what the
#: runtime computes from them (a list per layer, KV cache and compute estimates) small, and lie far
#: above every published model: 16384 heads, keys of 65536 values, a hidden size of 2**20, a
#: vocabulary of 2**24 tokens. 0 heads is allowed: hybrid models store 0 for their recurrent layers.
DIM_BOUNDS = {"block_count": (1, MAX_LAYERS), "embedding_length": (1, 1 << 20),
              "attention.head_count": (0, 1 << 14), "attention.head_count_kv": (0, 1 << 14),
              "attention.key_length": (0, 1 << 16), "attention.value_length": (0, 1 << 16),
              "vocab_size": (1, 1 << 24)}


@dataclass
class HeaderScan:
    version: int
    n_tensors: int
    metadata: dict[str, Any]            # scalars, strings, and small arrays (_KEEP_ARRAY_LEN)
    array_lengths: dict[str, int]       # every array's length (vocabularies included)
    tensors: list[tuple[str, tuple[int, ...], int, int]]   # (name, shape, ggml type, offset)
    data_start: int
    #: every key's GGUF value type, and its element type for an array (None otherwise)
    types: dict[str, tuple[int, int | None]] = field(default_factory=dict)


def tensor_bytes(shape: tuple[int, ...], ggml_type: int) -> int | None:
    """Bytes of a tensor's data as stored; None for a type the installed `gguf` package does not know."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None
    return math.prod(shape) // block_size * block_bytes


@dataclass(frozen=True)
class Dims:
    """The hyperparameters read from a header before llama.cpp has accepted the file, each bounded
    (DIM_BOUNDS); 0 where the file does not say. Per-layer arrays give their first value."""

    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    key_length: int
    value_length: int
    n_vocab: int

    @classmethod
    def of(cls, scan: HeaderScan, path: str | os.PathLike) -> Dims:
        meta = scan.metadata
        arch = meta.get("general.architecture", "")
        arch = arch if isinstance(arch, str) else ""

        def value(key: str) -> int:
            full = f"{arch}.{key}"
            v = meta.get(full)
            items = v if isinstance(v, list) else [] if v is None else [v]
            lo, hi = DIM_BOUNDS[key]
            for x in items:
                if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
                    raise CorruptGGUF(f"{path} is not a valid GGUF: {full} is {x!r} (an integer from {lo} to "
                                      f"{hi} in any model llama.cpp runs). The file is damaged or crafted; "
                                      "download or convert it again.")
            if scan.array_lengths.get(full, 0) > MAX_LAYERS:
                raise CorruptGGUF(f"{path} is not a valid GGUF: {full} is an array of "
                                  f"{scan.array_lengths[full]} values (one per layer at most, {MAX_LAYERS} layers).")
            return items[0] if items else 0

        n_embd, n_head = value("embedding_length"), value("attention.head_count")
        key_length = value("attention.key_length") or (n_embd // n_head if n_head else 0)
        n_vocab = value("vocab_size") or scan.array_lengths.get("tokenizer.ggml.tokens", 0)
        return cls(arch, value("block_count"), n_embd, n_head, value("attention.head_count_kv") or n_head,
                   key_length, value("attention.value_length") or key_length, n_vocab)


def scan_header(path: str | os.PathLike) -> HeaderScan:
    """Walk a GGUF's header, metadata and tensor index with every size checked against the file.

    Raises NotGGUF, TruncatedGGUF or CorruptGGUF with what is wrong. Reads through a memory map, so
    only the pages it looks at are read.
    """
    import mmap
    import struct

    check_header(path)
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        if size < 24:
            raise TruncatedGGUF(f"{p} is truncated: {size} bytes is less than a GGUF header. "
                                "Copy or download the file again.")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        pos = 4

        def cut(what: str) -> TruncatedGGUF:
            return TruncatedGGUF(f"{p} is truncated or damaged: {what} runs past the end of the file "
                                 f"({size} bytes). Copy or download the file again.")

        def bad(what: str) -> CorruptGGUF:
            return CorruptGGUF(f"{p} is not a valid GGUF: {what}. The file is damaged or was not made by a "
                               "GGUF writer; download or convert it again.")

        def overrun(nbytes: int, what: str, claim: str) -> Exception:
            """Past the end: a plausible size means a cut file, an absurd one a damaged field."""
            return cut(what) if nbytes <= PLAUSIBLE_BYTES else bad(f"{what} claims {claim}")

        def take(fmt: str, what: str):
            nonlocal pos
            n = struct.calcsize(fmt)
            if pos + n > size:
                raise cut(what)
            v = struct.unpack_from(fmt, mm, pos)[0]
            pos += n
            return v

        def string(what: str, limit: int | None = None) -> str:
            nonlocal pos
            n = take("<Q", what)
            if limit is not None and n > limit:
                raise bad(f"{what} is {n} bytes long (at most {limit})")
            if pos + n > size:
                raise overrun(n, what, f"{n} bytes")
            v = bytes(mm[pos:pos + n]).decode("utf-8", "replace")
            pos += n
            return v

        def skip_strings(count: int, what: str) -> None:
            nonlocal pos
            for _ in range(count):
                n = take("<Q", what)
                if pos + n > size:
                    raise cut(what)
                pos += n

        version = take("<I", "the version")
        if version not in (2, 3):
            raise bad(f"version {version} (llama.cpp reads versions 2 and 3)")
        n_tensors = take("<Q", "the tensor count")
        n_kv = take("<Q", "the metadata count")
        # every entry takes at least 12 bytes (an empty key and a type), every tensor 24
        if n_kv * 12 > size or n_tensors * 24 > size:
            raise overrun(n_kv * 12 + n_tensors * 24, "the metadata", f"{n_kv} entries and {n_tensors} tensors")
        meta: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        types: dict[str, tuple[int, int | None]] = {}
        for _ in range(n_kv):
            key = string("a metadata key", MAX_KEY_BYTES)
            vtype = take("<I", f"the type of {key!r}")
            types[key] = (vtype, None)
            if vtype == STRING:
                meta[key] = string(f"the value of {key!r}")
            elif vtype == ARRAY:
                etype = take("<I", f"the element type of {key!r}")
                types[key] = (vtype, etype)
                count = take("<Q", f"the length of {key!r}")
                lengths[key] = count
                if etype == STRING:
                    if count * 8 > size - pos:
                        raise overrun(count * 8, repr(key), f"{count} strings")
                    if count <= (_KEEP_A3B_LEN if key.startswith("a3b.") else _KEEP_ARRAY_LEN):
                        meta[key] = [string(f"an item of {key!r}") for _ in range(count)]
                    else:
                        skip_strings(count, f"the items of {key!r}")
                elif etype in _SCALAR:
                    nbytes = count * _SCALAR[etype]
                    if nbytes > size - pos:
                        raise overrun(nbytes, repr(key), f"{count} items")
                    if count <= (_KEEP_A3B_LEN if key.startswith("a3b.") else _KEEP_NUMBERS_LEN):
                        meta[key] = [v[0] for v in struct.iter_unpack(_FMT[etype], mm[pos:pos + nbytes])]
                    pos += nbytes
                else:
                    raise bad(f"{key!r} is an array of type {etype} (nested or unknown)")
            elif vtype in _SCALAR:
                meta[key] = take(_FMT[vtype], f"the value of {key!r}")
            else:
                raise bad(f"{key!r} has the unknown value type {vtype}")
        for key in _STRING_KEYS:
            if key in meta and not isinstance(meta[key], str):
                raise bad(f"{key} must be a string, not {type(meta[key]).__name__}")
            if key in lengths:
                raise bad(f"{key} must be a string, not an array")
        tensors = []
        for _ in range(n_tensors):
            name = string("a tensor name", MAX_KEY_BYTES)
            n_dims = take("<I", f"the rank of {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise bad(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
            shape = tuple(take("<Q", f"the shape of {name!r}") for _ in range(n_dims))
            if any(d <= 0 or d > 1 << 40 for d in shape):
                raise bad(f"tensor {name!r} has the shape {shape}")
            ttype = take("<I", f"the type of {name!r}")
            offset = take("<Q", f"the offset of {name!r}")
            tensors.append((name, shape, ttype, offset))
        if "general.alignment" in types and types["general.alignment"][0] != UINT32:
            # llama.cpp reads it with gguf_get_val_u32, which asserts (aborts) on any other type
            raise bad(f"general.alignment is stored as {type_name(*types['general.alignment'])}, not uint32")
        align = meta.get("general.alignment", 32)
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise bad(f"general.alignment is {align!r} (a power of two)")
        data_start = (pos + align - 1) // align * align
        if n_tensors and data_start > size:
            raise cut("the tensor data")
        data_bytes = size - data_start
        for name, shape, ttype, offset in tensors:
            n = math.prod(shape)
            nbytes = tensor_bytes(shape, ttype)
            # no type takes less than a bit per value: this bounds a tensor of a type unknown here too
            if n > 8 * data_bytes or (nbytes is not None and offset + nbytes > data_bytes):
                raise overrun(offset + (nbytes or n // 8), f"the data of tensor {name!r}",
                              f"{n} values at offset {offset}")
        return HeaderScan(version, n_tensors, meta, lengths, tensors, data_start, types)
    finally:
        mm.close()
