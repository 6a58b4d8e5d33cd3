"""The pruned mixture-of-experts file, one tensor at a time (writing/gguf.py).

Removing experts slices the stored bytes of the expert tensors and of the router rows; narrowed
experts keep their gate/up rows as stored bytes and requantise their down projection per expert
(writing/align.py: its own type, or llama-quantize's fallback).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..source import SourceModel
from ..writing import gguf
from ..writing.align import down_type
from ..layout import layer_of
from .layout import DOWN_EXPS, EXPERT_TENSORS, FUSED_EXPS, GATE_UP_EXPS, KNOWN, ROUTER, SHARED_DOWN, SHARED_GATE, \
    SHARED_ROWS, MoELayout
from .plan import MoEPlan, dequant


def expert_tensors(src: SourceModel, lay: MoELayout, pl: MoEPlan, k: int,
                   k_shared: int | None) -> list[gguf.OutTensor]:
    """Every output tensor, made when written (one in memory at a time)."""
    out = []
    for name in src.tensors:
        il = layer_of(name)
        part = name.split(".", 2)[2] if il is not None else ""
        qt, shape = src.qtype(name), src.shape(name)
        experts = pl.experts.get(il) if il is not None else None
        narrow = il in pl.neurons
        if experts is None or part not in KNOWN or part == SHARED_GATE:
            out.append(gguf.copy_tensor(src, name))
        elif part == ROUTER or part in EXPERT_TENSORS and not narrow:
            out.append(gguf.copy_tensor(src, name) if len(experts) == lay.n_expert
                       else gguf.rows_tensor(src, name, experts))
        elif part in GATE_UP_EXPS or part == FUSED_EXPS:
            rows = pl.neurons[il]
            if part == FUSED_EXPS:
                rows = np.concatenate([rows, rows + lay.n_ff_exp], axis=1)

            def make(name=name, experts=experts, rows=rows):
                data = src.stored(name)
                return np.stack([np.asarray(data[e])[r] for e, r in zip(experts, rows)])
            out.append(gguf.OutTensor(name, qt, (len(experts), rows.shape[1], shape[-1]), make))
        elif part == DOWN_EXPS:
            dqt = down_type(qt, k)

            def make(name=name, il=il, experts=experts, qt=qt, dqt=dqt):
                data = src.stored(name)
                return np.stack([gguf.encode(np.take(dequant(data[e], qt), r, axis=1), dqt, im)
                                 for e, r, im in zip(experts, pl.neurons[il], pl.imatrix[il])])
            out.append(gguf.OutTensor(name, dqt, (len(experts), shape[1], k), make))
        elif il not in pl.shared:
            out.append(gguf.copy_tensor(src, name))
        elif part in SHARED_ROWS:
            out.append(gguf.rows_tensor(src, name, pl.shared[il]))
        else:  # the shared expert's down projection
            dqt = down_type(qt, k_shared)
            out.append(gguf.value_tensor(name, dqt, (shape[0], k_shared),
                                           lambda name=name, il=il: np.take(src.weight(name), pl.shared[il], axis=1),
                                           lambda il=il: pl.shared_imatrix[il]))
    return out


def used_after(lay: MoELayout, n_keep: int) -> int | list[int]:
    u = lay.n_expert_used
    return [min(x, n_keep) for x in u] if isinstance(u, list) else min(u, n_keep)


def write_pruned(src: SourceModel, lay: MoELayout, pl: MoEPlan, out: str | Path, k: int, k_shared: int | None,
                 meta: dict[str, Any], *, progress: bool = False, should_stop=None) -> None:
    """Write `src` pruned as `pl` says to `out` (complete or not at all): the expert count, experts used
    per token (capped at the new count) and expert widths written once, `meta` as a3b.* keys."""
    n_keep = len(pl.experts[0])
    tensors = expert_tensors(src, lay, pl, k, k_shared)
    arch = lay.arch
    kv: dict[str, Any] = {f"{arch}.expert_count": n_keep, f"{arch}.expert_used_count": used_after(lay, n_keep),
                          f"{arch}.expert_feed_forward_length": k}
    if k_shared is not None:
        kv[f"{arch}.expert_shared_feed_forward_length"] = k_shared
    meta = {**meta, "requant.fallback_tensors": sum(
        1 for x in tensors if x.name.endswith((DOWN_EXPS, SHARED_DOWN)) and x.qtype != src.qtype(x.name))}
    gguf.write_file(src, Path(out), tensors, n_ff=None, a3b=meta, kv=kv, progress=progress, should_stop=should_stop)
