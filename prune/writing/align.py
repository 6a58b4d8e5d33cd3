"""The FFN width a pruned file can store: whole quantisation blocks, or llama-quantize's fallback type.

A row of a quantised tensor is a whole number of blocks (32 values for Q4_0 / Q4_1 / Q8_0, 256 for
the K-quants, 1 for F32 / F16 / BF16). Pruning shortens the rows of the down projections (their
length is the FFN width), so by default the width is rounded to a multiple of every down
projection's block size: each keeps its type. A smaller --align stores the down projections that
cannot hold the width in the type llama-quantize falls back to for such rows.
"""
from __future__ import annotations

import math

from gguf import GGMLQuantizationType as T

from ...runtime.llama.ggml import block_size
from ..source import SourceModel

#: llama-quantize's rule for a row length a 256-block type cannot store (by ggml type name): the
#: 32-block type it uses instead. A pruned ffn_down falls back the same way when --align asks for a
#: width that is not a multiple of 256.
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL",
            "IQ3_S": "IQ4_NL", "IQ3_XXS": "IQ4_NL", "IQ2_S": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_XXS": "IQ4_NL",
            "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0"}


def block_align(src: SourceModel, part: str, n_layer: int) -> int:
    """The least width that fills whole blocks of `blk.<i>.<part>` in every layer (the default --align)."""
    a = 1
    for i in range(n_layer):
        a = math.lcm(a, block_size(src.qtype(f"blk.{i}.{part}")))
    return a


def width_align(src: SourceModel, align: int | None, part: str, n_layer: int) -> int:
    """--align as given, or by default `block_align` (what the output records as a3b.align)."""
    return int(align) if align is not None else block_align(src, part, n_layer)


def down_type(qtype: int, k: int) -> int:
    """The type a pruned down projection of width `k` is stored in: its own, or llama-quantize's fallback."""
    if k % block_size(qtype) == 0:
        return qtype
    fb = FALLBACK.get(T(qtype).name)
    if fb is not None and k % block_size(T[fb]) == 0:
        return int(T[fb])
    return int(T.F16)


def width_for(keep: float, n_ff: int, align: int) -> int:
    """FFN width for a keep ratio, rounded to a multiple of `align` (the quantisation block)."""
    align = max(1, int(align))
    k = int(round(keep * n_ff / align)) * align
    return int(min(n_ff, max(align, k)))
