"""Pruned variants made once and cached on disk, keyed by the source's SHA-256 and the settings.

The A3BLoader node (and anything else) calls `cached_variant(source, keep=..., method=...)`: the
first call prunes (minutes on a CPU), later calls return the cached path at once. Files are written
atomically (temporary name, then rename), so an interrupted run leaves no file that a later call
would mistake for a finished one; a lock file serialises concurrent makers of the same variant.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..runtime.models.gguf_info import sha256_file
from .config import PruneConfig, default_cache_dir, with_device_defaults
from .errors import InvalidRequest
from .pipeline import prune
from .settings import EXPERTS_KEEP, recover_steps_for
from .source import SourceModel

_sha_memo: dict[tuple[str, int, int], str] = {}


def _source_sha(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _sha_memo:
        _sha_memo[key] = sha256_file(path)
    return _sha_memo[key]


def variant_path(source_path: str | os.PathLike, cfg: PruneConfig, cache_dir: str | os.PathLike | None = None) -> Path:
    src = Path(source_path).resolve()
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    stem = src.name[:-5] if src.name.endswith(".gguf") else src.name
    experts = f"-e{cfg.expert_method}{cfg.experts_keep:g}" if cfg.experts_keep < 1.0 else ""
    name = (f"{stem}.a3b-{cfg.method}-keep{cfg.keep:g}{experts}-r{cfg.recover_steps}-{_source_sha(src)[:12]}"
            f"-{cfg.key()}.gguf")
    return base / "variants" / name


@contextlib.contextmanager
def _lock(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_variant(source_path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                   progress: bool = False, **settings: Any) -> Path:
    """Return the path of the pruned variant, making it first if it is not cached yet.

    `settings` are PruneConfig fields (keep=..., method=..., ...); those left out, or given as None,
    take PruneConfig's defaults, or for recovery on a CUDA GPU config.GPU_RECOVERY's; expert pruning
    and mixture-of-experts models run one-shot (settings.recover_steps_for).
    """
    known = {f.name for f in fields(PruneConfig)}
    unknown = set(settings) - known
    if unknown:
        raise InvalidRequest(f"unknown pruning settings: {', '.join(sorted(unknown))}")
    PruneConfig(**{k: v for k, v in settings.items() if v is not None}).validate()   # as given
    SourceModel(source_path, torch_reference=False)  # typed errors (missing file, not a GGUF) before any work
    settings["recover_steps"] = recover_steps_for(settings.get("recover_steps"), source=source_path,
                                                  experts_keep=settings.get("experts_keep") or EXPERTS_KEEP.default)
    settings = with_device_defaults(settings)
    cfg = PruneConfig(**{k: v for k, v in settings.items() if v is not None})
    cfg.validate()
    out = variant_path(source_path, cfg, cache_dir)
    if out.is_file():
        return out
    with _lock(out.with_name(out.name + ".lock")):
        if out.is_file():  # made by another process while we waited
            return out
        prune(source_path, out, cfg, force=False, progress=progress,
              cache_dir=Path(cache_dir) if cache_dir is not None else None)
    return out
