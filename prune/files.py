"""Files that appear under their final name only when complete: the output GGUF and the caches.

Everything pruning writes (the pruned file, calibration statistics, per-layer plans, distillation
checkpoints) is written under a temporary name in the same folder and renamed, so an interrupted
run leaves no file that a later run would take for a finished one.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .errors import OutputExists


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `final`; rename it to `final` only if the block completes."""
    final = Path(final)
    if final.exists() and not force:
        raise OutputExists(f"{final} already exists; choose another --out or pass --force to replace it.")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.part-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def save_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez under a temporary name, then rename: an interrupted run leaves no half-written cache."""
    tmp = path.with_name(f".{path.name}.part-{os.getpid()}.npz")
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def load_npz(path: Path) -> dict[str, np.ndarray] | None:
    """Every array of a cached .npz, or None where it is missing or damaged (then it is made again)."""
    try:
        with np.load(path) as z:
            return {n: z[n] for n in z.files}
    except (OSError, KeyError, ValueError):
        return None
