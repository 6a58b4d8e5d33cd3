"""A3B gated-FFN pruning (needs the `prune` extra: torch).

    a3b prune MODEL --keep 0.63 --method a3b --recover-steps 160 --out pruned.gguf

Importing this package does not import torch; the steps that need it (reference forward,
calibration, distillation, dynamic gate) raise `TorchMissing` naming
`pip install 'comfyui-a3b[prune]'` when it is not installed. Reading GGUFs, writing and quantising
pruned files, and llama.cpp evaluation work without torch.

Floors, each importing only those below it (llama.cpp itself is reached through runtime/llama):

    pipeline.py, cache.py, cli.py   prune(): which path a run takes; cached variants; `a3b prune`
                                    (output.py: where its file goes and what it prints)
    experts/                        mixture-of-experts pruning (whole experts, expert neurons)
    dense/                          FFN-neuron and head pruning of dense models; recovery
    calibration/, writing/          statistics of the unpruned model; the pruned file and its metadata
    config, settings, layout, source, corpus, wide, textfiles, reference, files, ...   the settings
                                    (declared in settings.py, a run's in config.PruneConfig), architectures,
                                    sources, text (the built-in corpus, the wide corpus, a user's files)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import METHODS, PruneConfig
from .errors import CorpusTooSmall, OutputExists, PruneInterrupted, TorchMissing, require_torch
from .layout import TORCH_ARCHITECTURES as SUPPORTED_ARCHITECTURES

__all__ = ["METHODS", "PruneConfig", "SUPPORTED_ARCHITECTURES", "CorpusTooSmall", "OutputExists", "PruneInterrupted",
           "TorchMissing", "cached_variant", "cli_main", "prune", "require_torch"]


def prune(source, out, config=None, **kwargs: Any):
    """Prune `source` into `out` (see pipeline.prune)."""
    from .pipeline import prune as _prune

    return _prune(source, out, config, **kwargs)


def cached_variant(source_path, **settings: Any) -> Path:
    """Path of a pruned variant of `source_path`, made once and cached on disk (see cache.py)."""
    from .cache import cached_variant as _cv

    return _cv(source_path, **settings)


def cli_main(args) -> int:
    """Run `a3b prune` with arguments parsed by the `a3b` parser (see cli.py and prune/cli.py)."""
    from .cli import run

    return run(args)
