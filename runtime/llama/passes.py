"""Counting llama.cpp's passes through the model: how many micro-batches a decode step became.

A diagnostic (A3B_COUNT_PASSES=on), for the tests and benchmarks that check that a step of many
requests is one pass (slots.py says why it may not be). llama.cpp asks its graph evaluation
callback (`cb_eval`) about every node of every graph it computes; the first layer's attention norm
(`attn_norm-0`) is in every graph of a decoder once, so its questions count the graphs. Asking from
Python costs a few microseconds per node: off unless asked for.
"""
from __future__ import annotations

import ctypes
from typing import Any

from ..environment import env_on
from . import ggml

#: the node whose evaluation marks one pass
MARK = b"attn_norm-0"


class PassCounter:
    def __init__(self) -> None:
        self.count = 0
        #: (tokens, sequences, passes) of each decode call, in order (what the benchmarks report per step)
        self.per_step: list[tuple[int, int, int]] = []
        self.callback = ggml.EVAL_CALLBACK(self._ask)   # kept alive with the context
        #: the model's stats counter (worker.py), where it is given one
        self.stats: Any = None

    def _ask(self, ptr, ask, _user) -> bool:
        if ask and ctypes.cast(ptr, ggml.TensorPtr).contents.name == MARK:
            self.count += 1
        return False   # no node's data is wanted: llama.cpp computes each split whole

    def record(self, tokens: int, sequences: int, passes: int) -> None:
        """One decode call: `tokens` over `sequences` took `passes`; into the model's stats too
        (`passes`, `counted_steps`, and for steps of one token in each of several sequences
        `decode_steps` and `decode_step_passes`)."""
        self.per_step.append((tokens, sequences, passes))
        if self.stats is not None:
            self.stats["passes"] += passes
            self.stats["counted_steps"] += 1
            if tokens == sequences > 1:
                self.stats["decode_steps"] += 1
                self.stats["decode_step_passes"] += passes

    def attach(self, params) -> None:
        params.cb_eval = self.callback
        params.cb_eval_user_data = None


def counter() -> PassCounter | None:
    """A counter when A3B_COUNT_PASSES is on, else None."""
    return PassCounter() if env_on("A3B_COUNT_PASSES") else None
