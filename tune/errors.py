"""Errors of the tuner. All are `A3BError`s, so the CLI prints one line and exits 2."""
from __future__ import annotations

from ..runtime.errors import A3BError, InvalidRequest, UnsupportedArchitecture  # noqa: F401  (re-exported)


class NoSources(A3BError):
    """The folder holds no source file the tuner can learn from (or too few to hold some out)."""

    code = "no_sources"


class NotEnoughMemory(A3BError):
    code = "not_enough_memory"


class TuneInterrupted(A3BError):
    code = "tune_interrupted"
