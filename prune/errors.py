"""Errors of the pruning pipeline. All are `A3BError`s, so the CLI prints one line and exits 2."""
from __future__ import annotations

import os

from ..runtime.errors import A3BError, InvalidRequest, UnsupportedArchitecture  # noqa: F401  (re-exported)

INSTALL_HINT = "pip install 'comfyui-a3b[prune]'"


class TorchMissing(A3BError):
    """The step needs PyTorch (the reference forward, calibration, distillation, dynamic gate)."""

    code = "torch_missing"


class OutputExists(A3BError):
    code = "output_exists"


class CorpusTooSmall(A3BError):
    code = "corpus_too_small"


class PruneInterrupted(A3BError):
    code = "prune_interrupted"


def require_torch():
    """Import torch or raise TorchMissing with the install command."""
    # MKL's own memory manager keeps the buffers of its matrix products for later ones; without it
    # recovery of the embedded model peaked 25 MiB lower at the same step time (only where torch
    # is not imported yet: MKL reads this once)
    os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")
    try:
        import torch
    except ImportError as e:
        raise TorchMissing(f"A3B pruning needs PyTorch, which is not installed. Install the 'prune' extra: "
                           f"{INSTALL_HINT}") from e
    return torch
