"""`prune()`: which path a run takes, and the checks before any work.

- a mixture-of-experts model, or --experts-keep: experts/run.py (one-shot, calibrated through llama.cpp);
- recovery, head pruning or --calibration torch: dense/torch_path.py (the torch reference forward);
- otherwise: dense/llama_path.py (one-shot, calibrated through llama.cpp, streamed in bounded memory).

Safe to interrupt: the output appears under its final name only once complete (files.atomic_path),
and the expensive parts (calibration statistics, plans, distillation checkpoints) are cached on disk
so a second run resumes after them.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..runtime.models.gguf_info import inspect_gguf
from .config import PruneConfig
from .dense.llama_path import prune_streamed
from .errors import InvalidRequest, OutputExists, UnsupportedArchitecture
from .experts.run import prune_moe
from .layout import TORCH_ARCHITECTURES
from .writing.metadata import PruneResult


def choose_calibration(cfg: PruneConfig, arch: str) -> str:
    """'torch' or 'llama': where a run's statistics come from (see PruneConfig.calibration)."""
    needs_torch = (cfg.keep < 1.0 and cfg.recover_steps > 0) or cfg.heads_keep < 1.0
    torch_ok = arch in TORCH_ARCHITECTURES
    what = ("recovery (--recover-steps)" if cfg.keep < 1.0 and cfg.recover_steps > 0 else "head pruning")
    if cfg.calibration == "torch":
        if not torch_ok:
            raise UnsupportedArchitecture(
                f"--calibration torch needs the torch reference forward, which knows {', '.join(TORCH_ARCHITECTURES)}; "
                f"this model is {arch!r}. Use --calibration llama (or auto).")
        return "torch"
    if cfg.calibration == "llama":
        if needs_torch:
            raise InvalidRequest(f"{what} runs on the torch reference forward; with --calibration llama pass "
                                 "--recover-steps 0 and --heads-keep 1, or use --calibration torch (or auto).")
        return "llama"
    if needs_torch:
        if not torch_ok:
            raise UnsupportedArchitecture(
                f"{what} needs the torch reference forward, which knows {', '.join(TORCH_ARCHITECTURES)}; this model "
                f"is {arch!r}. Pass --recover-steps 0 (and --heads-keep 1) for one-shot pruning calibrated through "
                "llama.cpp.")
        return "torch"
    # One-shot: llama.cpp's statistics of the file as served gave lower held-out perplexity than the
    # torch path's (its one-shot obs and its sequential a3b alike) at keep 0.9, 0.8 and 0.63 on the
    # embedded model (bench_prune_llama), in bounded memory: the torch path is for what needs it.
    return "llama"


def prune(source: str | os.PathLike, out: str | os.PathLike, cfg: PruneConfig | None = None, *,
          force: bool = False, progress: bool = True, cache_dir: str | os.PathLike | None = None,
          should_stop=None, notify=None) -> PruneResult:
    """Prune `source` into `out` with `cfg` (see the module docstring for the path it takes). `notify`
    says the lines a run has for its user (how long recovery will take); by default beside the
    progress bars, or in the log without them."""
    cfg = cfg or PruneConfig()
    cfg.validate()
    out = Path(out)
    if out.exists() and not force:
        raise OutputExists(f"{out} already exists; choose another --out or pass --force to replace it.")
    info = inspect_gguf(source)
    kw = {"progress": progress, "cache_dir": cache_dir, "should_stop": should_stop}
    if cfg.experts_keep < 1.0 or info.expert_count:
        return prune_moe(source, out, cfg, **kw)  # mixture-of-experts models, and the error for a dense one
    if choose_calibration(cfg, info.architecture) == "llama":
        return prune_streamed(source, out, cfg, **kw)
    from .dense.torch_path import prune_torch  # imports torch, which the other paths do without

    return prune_torch(source, out, cfg, notify=notify, **kw)
