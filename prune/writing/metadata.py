"""What a pruned file records about how it was made (its `a3b.*` keys), and what a run returns.

Every path (the torch path, one-shot pruning calibrated through llama.cpp, expert pruning) records
the same core keys, built here once; each adds what only it knows (its selection, its calibration,
its recovery, its experts). writing/gguf.py stores them under `a3b.` with the format version.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import PruneConfig
from ..source import SourceModel

#: what a run without recovery records about it
NO_RECOVERY = {"recover.steps": 0, "recover.kind": "none", "recover.final_kl": 0.0}


@dataclass
class PruneResult:
    path: Path
    n_ff_source: int
    n_ff: int
    metadata: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)
    distill_losses: list[float] = field(default_factory=list)


def a3b_metadata(src: SourceModel, cfg: PruneConfig, *, selection: str, align: int, n_ff: int, n_ff_source: int,
                 calib_engine: str, n_head: int | None = None, corpus: dict[str, Any] | None = None,
                 width_key: str = "n_ff", **extra: Any) -> dict[str, Any]:
    """The core a3b.* keys of a pruned file, then `extra` (keys of one path; they may replace core ones).

    `n_ff` / `n_ff_source` are the FFN width after and before, recorded as `width_key` and
    `<width_key>_source` (a mixture-of-experts file records its experts' width as n_ff_exp);
    `corpus` describes the calibration text (calibration/windows.py).
    """
    meta: dict[str, Any] = {
        "method": cfg.method, "selection": selection, "keep": float(cfg.keep), "keep_actual": n_ff / n_ff_source,
        f"{width_key}_source": n_ff_source, width_key: n_ff, "align": int(align),
        "heads_keep": float(cfg.heads_keep), "n_head": int(n_head if n_head is not None else src.hp.n_head),
        "n_head_source": src.hp.n_head,
        "source.sha256": src.sha256, "source.name": src.path.name,
        "source.file_type": int(src.hp.file_type) if src.hp.file_type is not None else 0,
        "calib.engine": calib_engine, **NO_RECOVERY, "seed": int(cfg.seed), "config": cfg.key(),
    }
    meta.update(corpus or {})
    meta.update(extra)
    return meta
