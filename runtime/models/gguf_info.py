"""GGUF inspection and verification (no llama.cpp needed).

`inspect_gguf` describes a file (`a3b inspect`, pruning, tuning) from the bounded header scan
(ggufscan.py); the `gguf` package's full reader, which takes seconds on a large vocabulary, only
reads what the scan leaves out. The model store does not use it before loading: llama.cpp reads the
same metadata in milliseconds (see runtime/models/vet.py for how a file llama.cpp could crash on is
checked first). `sha256_file` and `verify_sha256` check a download against its published digest.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ChecksumMismatch, InvalidRequest, ModelNotFound, TruncatedGGUF
from .ggufscan import HeaderScan, scan_header, tensor_bytes

@dataclass
class GGUFInfo:
    path: str
    file_size: int
    version: int
    architecture: str
    name: str | None
    n_params: int
    n_tensors: int
    context_length: int | None
    embedding_length: int | None
    block_count: int | None
    feed_forward_length: int | None
    head_count: int | None
    head_count_kv: int | None
    rope_freq_base: float | None
    file_type: str | None
    tensor_types: dict[str, int]
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    vocab_size: int | None
    pooling_type: int | None
    fim_tokens: dict[str, int]
    a3b: dict[str, Any] = field(default_factory=dict)
    # mixture-of-experts models: routed experts per layer, experts used per token, one expert's FFN width
    expert_count: int | None = None
    expert_used_count: int | list[int] | None = None
    expert_feed_forward_length: int | list[int] | None = None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["has_chat_template"] = self.has_chat_template
        d.pop("chat_template")
        return d


# llama.cpp's LLAMA_FTYPE numbering (general.file_type), for display.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
}

# Token names that mark fill-in-the-middle support, by GGUF key suffix.
_FIM_KEYS = ("fim_pre_token_id", "fim_suf_token_id", "fim_mid_token_id", "fim_pad_token_id",
             "fim_rep_token_id", "fim_sep_token_id")


def _field_value(field_) -> Any:
    """Decode a ReaderField to a Python value (str, number, or list)."""
    from gguf import GGUFValueType

    if not field_.types:
        return None
    main = field_.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field_.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field_.parts[i]).decode("utf-8", "replace") for i in field_.data]
        return [field_.parts[i].tolist()[0] for i in field_.data]
    if main == GGUFValueType.STRING:
        return bytes(field_.parts[field_.data[0]]).decode("utf-8", "replace")
    return field_.parts[field_.data[0]].tolist()[0]


def inspect_gguf(path: str | os.PathLike) -> GGUFInfo:
    """Read a GGUF's metadata and tensor index; raise a typed error for missing/foreign/cut files.

    From the bounded scan (tens of milliseconds): gguf's GGUFReader makes an object per vocabulary
    entry, 3 s for the embedded model's 49k tokens and merges, which every load, `a3b inspect` and
    each pruning step paid. The reader still reads what the scan leaves out: an `a3b.*` array longer
    than the scan keeps, or a tensor type the installed `gguf` does not know (its error stands)."""
    scan = scan_header(path)   # bounded: what a full reader would choke on is refused here
    p = Path(path)
    size = p.stat().st_size
    left_out = any(k.startswith("a3b.") and k not in scan.metadata for k in scan.types)
    if left_out or any(tensor_bytes(shape, t) is None for _, shape, t, _ in scan.tensors):
        return _inspect(p, size)
    return _from_scan(p, size, scan)


def _from_scan(p: Path, size: int, scan: HeaderScan) -> GGUFInfo:
    from gguf import GGMLQuantizationType

    meta = scan.metadata
    tensor_types: dict[str, int] = {}
    for _, _, t, _ in scan.tensors:
        name = GGMLQuantizationType(t).name
        tensor_types[name] = tensor_types.get(name, 0) + 1
    return _info(p, size, scan.version, meta, tensor_types, sum(math.prod(s) for _, s, _, _ in scan.tensors),
                 len(scan.tensors), scan.array_lengths.get("tokenizer.ggml.tokens"))


def _inspect(p: Path, size: int) -> GGUFInfo:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(p), "r")
    except (ValueError, IndexError, OSError, KeyError) as e:
        raise TruncatedGGUF(f"{p} is a damaged or truncated GGUF ({size} bytes): the metadata could "
                            f"not be read ({e}). Copy or download the file again.") from e
    # The reader memory-maps tensor data lazily: a file cut inside the tensor data reads fine up to
    # here, so check every tensor's extent against the file size.
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise TruncatedGGUF(f"{p} is truncated: tensor data needs {end} bytes, the file has {size}. "
                            "Copy or download the file again.")

    meta = {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    tensor_types: dict[str, int] = {}
    n_params = 0
    for t in reader.tensors:
        tensor_types[t.tensor_type.name] = tensor_types.get(t.tensor_type.name, 0) + 1
        n_params += int(t.n_elements)
    tokens = meta.get("tokenizer.ggml.tokens")
    version = int(_field_value(reader.fields["GGUF.version"])) if "GGUF.version" in reader.fields else 0
    return _info(p, size, version, meta, tensor_types, n_params, len(reader.tensors), len(tokens) if tokens else None)


def _info(p: Path, size: int, version: int, meta: dict[str, Any], tensor_types: dict[str, int], n_params: int,
          n_tensors: int, n_tokens: int | None) -> GGUFInfo:
    arch = meta.get("general.architecture") or "unknown"

    def k(suffix: str):
        return meta.get(f"{arch}.{suffix}")

    ftype = meta.get("general.file_type")
    fim = {key.split("_token_id")[0]: meta[f"tokenizer.ggml.{key}"]
           for key in _FIM_KEYS if f"tokenizer.ggml.{key}" in meta}
    return GGUFInfo(
        path=str(p.resolve()),
        file_size=size,
        version=version,
        architecture=arch,
        name=meta.get("general.name"),
        n_params=n_params,
        n_tensors=n_tensors,
        context_length=k("context_length"),
        embedding_length=k("embedding_length"),
        block_count=k("block_count"),
        feed_forward_length=k("feed_forward_length"),
        head_count=k("attention.head_count"),
        head_count_kv=k("attention.head_count_kv"),
        rope_freq_base=k("rope.freq_base"),
        file_type=FILE_TYPES.get(ftype, str(ftype)) if ftype is not None else None,
        tensor_types=tensor_types,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        vocab_size=n_tokens or None,
        pooling_type=k("pooling_type"),
        fim_tokens=fim,
        a3b={name: v for name, v in meta.items() if name.startswith("a3b.")},
        expert_count=k("expert_count"),
        expert_used_count=k("expert_used_count"),
        expert_feed_forward_length=k("expert_feed_forward_length"),
    )


def sha256_file(path: str | os.PathLike, progress: bool = False, chunk: int = 1 << 20) -> str:
    """Stream a file's SHA-256 (constant memory), with an optional tqdm progress bar."""
    p = Path(path)
    if not p.is_file():
        raise ModelNotFound(f"File not found: {p}")
    h = hashlib.sha256()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=p.stat().st_size, unit="B", unit_scale=True, desc=f"sha256 {p.name}")
    with open(p, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if bar is not None:
                bar.update(len(block))
    if bar is not None:
        bar.close()
    return h.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str, progress: bool = False) -> str:
    expected = expected.strip().lower()
    if len(expected) != 64 or any(c not in "0123456789abcdef" for c in expected):
        raise InvalidRequest(f"Not a SHA-256 hex digest: {expected!r} (expected 64 hex characters)")
    actual = sha256_file(path, progress=progress)
    if actual != expected:
        raise ChecksumMismatch(f"Checksum mismatch for {path}: expected {expected}, got {actual}. "
                               "The file is damaged or a different file; download it again.")
    return actual
