"""Expert pruning, the whole run: check the file, calibrate through llama.cpp, plan, write."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from ...runtime.models.memory import tune_allocator
from ..calibration.llama_stats import require_llama_runs
from ..calibration.windows import source_windows
from ..config import DATA_FREE, PruneConfig, default_cache_dir, refuse_torch_parts
from ..source import SourceModel
from ..writing.align import width_align, width_for
from ..writing.metadata import PruneResult, a3b_metadata
from .layout import DOWN_EXPS, SHARED_DOWN, check_moe_layout
from .plan import NEURON_SELECTION, n_experts_kept, plan, shared_method
from .stats import collect
from .write import used_after, write_pruned


def prune_moe(source, out, cfg: PruneConfig, *, progress: bool = True, cache_dir=None, should_stop=None):
    """Prune the experts (and expert neurons) of `source` into `out`. Returns a PruneResult."""
    t0 = time.perf_counter()
    tune_allocator()  # see runtime/models/memory.py: large arrays made and freed all run long go back whole
    timings: dict[str, float] = {}
    src = SourceModel(source, torch_reference=False)
    lay = check_moe_layout(src)
    require_llama_runs(src)
    refuse_torch_parts(cfg, "has no mixture-of-experts architecture")
    n_keep = n_experts_kept(cfg, lay, src.path.name)
    align = width_align(src, cfg.align, DOWN_EXPS, lay.n_layer)
    k = width_for(cfg.keep, lay.n_ff_exp, align)
    k_shared = None
    if lay.n_ff_shexp is not None:
        sa = width_align(src, cfg.align, SHARED_DOWN, lay.n_layer)
        k_shared = width_for(cfg.keep, lay.n_ff_shexp, sa)
    narrow = k < lay.n_ff_exp
    narrow_shared = k_shared is not None and k_shared < lay.n_ff_shexp
    data_methods = cfg.method not in DATA_FREE
    needs_stats = (n_keep < lay.n_expert and cfg.expert_method != "random") or \
        ((narrow or narrow_shared) and data_methods)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = Path(out)
    corpus_info: dict[str, Any] = {}
    st, cached = None, False
    timings["load"] = time.perf_counter() - t0
    t = time.perf_counter()
    if needs_stats:
        cfg, wins, corpus_info, _, _ = source_windows(src, cfg)
        st, cached = collect(src, lay, wins, cfg, neurons=narrow and data_methods,
                             shared=narrow_shared and data_methods, cache=cache, progress=progress,
                             should_stop=should_stop)
    timings["calibrate"] = time.perf_counter() - t
    t = time.perf_counter()
    pl = plan(src, lay, cfg, st, n_keep, k, k_shared)
    timings["plan"] = time.perf_counter() - t

    t = time.perf_counter()
    new_used = used_after(lay, n_keep)
    meta = a3b_metadata(
        src, cfg, selection=NEURON_SELECTION.get(cfg.method, cfg.method) if narrow else "none", align=align,
        n_ff=k, n_ff_source=lay.n_ff_exp, width_key="n_ff_exp", calib_engine="llama.cpp" if needs_stats else "none",
        corpus=corpus_info, kind="moe", **{
            "experts.method": cfg.expert_method if n_keep < lay.n_expert else "none",
            "experts.keep": float(cfg.experts_keep), "experts.keep_actual": n_keep / lay.n_expert,
            "n_expert": n_keep, "n_expert_source": lay.n_expert, "n_expert_used": new_used,
            "n_expert_used_source": lay.n_expert_used, "calib.n_gpu_layers": int(cfg.n_gpu_layers)})
    if k_shared is not None:
        meta.update({"n_ff_shexp": k_shared, "n_ff_shexp_source": lay.n_ff_shexp,
                     "shexp.selection": shared_method(cfg) if narrow_shared else "none"})
    if n_keep < lay.n_expert:
        for il in range(lay.n_layer):
            meta[f"experts.removed.{il}"] = [int(e) for e in np.setdiff1d(np.arange(lay.n_expert), pl.experts[il])]
    write_pruned(src, lay, pl, out, k, k_shared, meta, progress=progress, should_stop=should_stop)
    timings["write"] = time.perf_counter() - t
    meta["calib.cached"] = cached
    return PruneResult(out, lay.n_ff_exp, k, meta, timings, [])
