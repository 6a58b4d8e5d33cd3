"""A GGUF's metadata and tensor index read straight from its memory map, in memory that follows the values.

gguf's GGUFReader keeps a numpy view for every part of every metadata value: for a 49k-token
vocabulary and its merges some 175 MB of Python objects while it reads, and 80 MB still held (or
left fragmented) after its fields are dropped, for values of a few MB. Pruning holds its source
open for the whole run, calibration included, so that memory would count in every run's peak.

Here each value is decoded once into plain Python values, and the long arrays (the vocabulary, its
merges and token types) are not decoded at all until asked for: they stay an offset into the map,
read again when the writer copies them (`MetaField.contents`). Tensors are the same records the
reader makes (name, ggml type, shape in GGUF order, element and byte counts, absolute data offset,
a numpy view of the data). Little-endian files only (every file llama.cpp writes); the caller
(source.py) uses the reader for others. The caller checks the file's structure first
(gguf_info.inspect_gguf), so sizes here are trusted.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: scalar GGUF value types: struct format (little-endian)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: arrays longer than this stay undecoded until asked for (per-layer arrays are far shorter)
LAZY_ITEMS = 1024
#: ggml types whose data GGUFReader views as values, not bytes
_VALUE_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


class MetaField:
    """One metadata key: its GGUF value types (ARRAY then the item type, for arrays) and its value
    (`contents()`, as GGUFReader's field gives it: a Python scalar, a str, or a list)."""

    def __init__(self, types: list, value: Any = None, lazy: tuple[np.ndarray, int] | None = None):
        from gguf import GGUFValueType

        self.types = [GGUFValueType(t) for t in types]
        self._value = value
        self._lazy = lazy  # (the file's bytes, offset of the array's item type): decoded on each call

    def contents(self) -> Any:
        if self._lazy is None:
            return self._value
        data, pos = self._lazy
        return _Cursor(data, pos).array()[1]

    @property
    def value(self) -> Any:
        return self.contents()


@dataclass
class TensorRecord:
    """One tensor of the index, with the attributes of gguf's ReaderTensor that pruning reads."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order (ne), innermost first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    def __init__(self, data: np.ndarray, pos: int):
        self.data, self.pos = data, pos

    def scalar(self, fmt: str):
        v = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        v = bytes(self.data[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return v

    def value(self, vtype: int) -> tuple[list, Any]:
        """(types, value) of one value of `vtype` at the cursor."""
        if vtype == _STRING:
            return [vtype], self.string()
        if vtype == _ARRAY:
            return self.array()
        return [vtype], self.scalar(_SCALAR[vtype])

    def array(self) -> tuple[list, list]:
        itype, count = self.scalar("<I"), self.scalar("<Q")
        if itype in _SCALAR and itype != 7:  # numbers: one view, as Python values
            dt = np.dtype(_SCALAR[itype])
            vals = np.frombuffer(self.data, dt, count, self.pos).tolist()
            self.pos += count * dt.itemsize
            return [_ARRAY, itype], vals
        types, vals = [_ARRAY, itype], []
        for _ in range(count):
            sub, v = self.value(itype)
            vals.append(v)
            if itype == _ARRAY:
                types = [_ARRAY, *sub]
        return types, vals

    def skip_array(self) -> None:
        itype, count = self.scalar("<I"), self.scalar("<Q")
        if itype in _SCALAR:
            self.pos += count * struct.calcsize(_SCALAR[itype])
            return
        for _ in range(count):
            if itype == _STRING:
                n = self.scalar("<Q")  # the length, then that many bytes
                self.pos += n
            elif itype == _ARRAY:
                self.skip_array()


def little_endian(path: str | Path) -> bool:
    """Whether the file's version reads as a small number little-endian (GGUFReader's own test)."""
    with open(path, "rb") as f:
        head = f.read(8)
    return len(head) == 8 and struct.unpack_from("<I", head, 4)[0] & 0xFFFF != 0


def read_index(path: str | Path) -> tuple[np.memmap, dict[str, MetaField], dict[str, TensorRecord]]:
    """The file's map, its metadata (with GGUF.version, GGUF.tensor_count and GGUF.kv_count, as
    GGUFReader gives them) and its tensors in file order."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    data = np.memmap(path, mode="r")
    c = _Cursor(data, 4)
    version, n_tensors, n_kv = c.scalar("<I"), c.scalar("<Q"), c.scalar("<Q")
    fields = {"GGUF.version": MetaField([4], version), "GGUF.tensor_count": MetaField([10], n_tensors),
              "GGUF.kv_count": MetaField([10], n_kv)}
    for _ in range(n_kv):
        key = c.string()
        vtype = c.scalar("<I")
        if vtype == _ARRAY:
            start = c.pos
            itype, count = struct.unpack_from("<IQ", data, start)
            if count > LAZY_ITEMS and itype != _ARRAY:
                c.skip_array()
                fields[key] = MetaField([_ARRAY, itype], lazy=(data, start))
                continue
        types, value = c.value(vtype)
        fields[key] = MetaField(types, value)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.scalar("<I")
        dims = tuple(int(x) for x in np.frombuffer(data, "<u8", n_dims, c.pos))
        c.pos += 8 * n_dims
        infos.append((name, dims, c.scalar("<I"), c.scalar("<Q")))
    align = fields.get("general.alignment")
    align = int(align.contents()) if align is not None else 32
    start = -(-c.pos // align) * align
    tensors: dict[str, TensorRecord] = {}
    for name, dims, raw_type, offset in infos:
        if name in tensors:
            raise ValueError(f"Found duplicated tensor with name {name}")
        qtype = GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elems * type_size // block
        np_dims = tuple(reversed(dims))
        at = start + offset
        dt = _VALUE_DTYPES.get(qtype.name)
        if dt is not None:
            view = np.frombuffer(data, dt, n_elems, at).reshape(np_dims)
        else:
            view = np.frombuffer(data, np.uint8, n_bytes, at).reshape(quant_shape_to_byte_shape(np_dims, qtype))
        tensors[name] = TensorRecord(name, qtype, dims, n_elems, n_bytes, at, view)
    return data, fields, tensors
