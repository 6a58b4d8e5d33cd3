"""GGUF inspection and verification with the `gguf` package (no llama.cpp needed).

`inspect_gguf` reads only the header, metadata and tensor index (memory-mapped), so it is cheap even
for multi-GB files, and it is the first thing the store does before handing a file to llama.cpp:
llama.cpp's own errors for a truncated or foreign file are a NULL pointer and a log line, ours say
what is wrong.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ChecksumMismatch, InvalidRequest, ModelNotFound, NotGGUF, TruncatedGGUF

GGUF_MAGIC = b"GGUF"


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


def inspect_gguf(path: str | os.PathLike) -> GGUFInfo:
    """Read a GGUF's metadata and tensor index; raise a typed error for missing/foreign/cut files."""
    check_header(path)
    p = Path(path)
    size = p.stat().st_size
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
    arch = meta.get("general.architecture") or "unknown"

    def k(suffix: str):
        return meta.get(f"{arch}.{suffix}")

    tensor_types: dict[str, int] = {}
    n_params = 0
    for t in reader.tensors:
        tensor_types[t.tensor_type.name] = tensor_types.get(t.tensor_type.name, 0) + 1
        n_params += int(t.n_elements)
    ftype = meta.get("general.file_type")
    tokens = meta.get("tokenizer.ggml.tokens")
    fim = {key.split("_token_id")[0]: meta[f"tokenizer.ggml.{key}"]
           for key in _FIM_KEYS if f"tokenizer.ggml.{key}" in meta}
    return GGUFInfo(
        path=str(p.resolve()),
        file_size=size,
        version=int(_field_value(reader.fields["GGUF.version"])) if "GGUF.version" in reader.fields else 0,
        architecture=arch,
        name=meta.get("general.name"),
        n_params=n_params,
        n_tensors=len(reader.tensors),
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
        vocab_size=len(tokens) if tokens else None,
        pooling_type=k("pooling_type"),
        fim_tokens=fim,
        a3b={name: v for name, v in meta.items() if name.startswith("a3b.")},
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
