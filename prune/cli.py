"""`a3b prune MODEL --keep 0.63 --method a3b --recover-steps 160 --out FILE` (flags parsed here)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .methods import METHODS


def build_parser() -> argparse.ArgumentParser:
    from .pipeline import PruneConfig

    d = PruneConfig()  # one place for the defaults: the CLI, cached_variant and the A3BLoader agree
    p = argparse.ArgumentParser(prog="a3b prune", description="A3B gated-FFN pruning of a llama/qwen2/qwen3 GGUF.")
    p.add_argument("--keep", type=float, default=d.keep, help="fraction of FFN neurons kept in every layer, in (0, 1]")
    p.add_argument("--method", choices=METHODS, default=d.method, help=f"neuron importance method (default {d.method})")
    p.add_argument("--heads-keep", type=float, default=d.heads_keep,
                   help="fraction of the query heads of every KV group kept (default 1: no head pruning)")
    p.add_argument("--recover-steps", type=int, default=d.recover_steps,
                   help=f"distillation steps after pruning (0 = none; default {d.recover_steps})")
    p.add_argument("--out", "-o", default=None, help="output GGUF (default: beside the model, *.a3b-<method>-<keep>.gguf)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--calib-windows", type=int, default=d.calib_windows,
                   help=f"calibration windows (default {d.calib_windows})")
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help=f"tokens per calibration window (default {d.seq_len})")
    p.add_argument("--calib-file", action="append", default=[], help="calibrate on this text file instead of the "
                   "built-in standard-library corpus (repeatable)")
    p.add_argument("--lr", type=float, default=d.lr, help=f"distillation learning rate (default {d.lr:g})")
    p.add_argument("--recover-batch", type=int, default=d.recover_batch,
                   help=f"windows per distillation step (default {d.recover_batch})")
    p.add_argument("--recover-seq-len", type=int, default=d.recover_seq_len,
                   help=f"tokens per distillation window (default {d.recover_seq_len})")
    p.add_argument("--recover-train", choices=("all", "ffn"), default=d.recover_train,
                   help="tensors distillation trains: every block tensor (default) or only the FFN")
    p.add_argument("--recover-code-share", type=float, default=d.recover_code_share,
                   help=f"share of code windows in distillation batches, the rest prose (default {d.recover_code_share:g})")
    p.add_argument("--no-qat", dest="qat", action="store_false",
                   help="train in float and quantise once at the end, instead of through llama.cpp's quantiser")
    p.add_argument("--gate-sparsity", type=float, default=d.gate_sparsity,
                   help="target sparsity of the stored dynamic gate")
    p.add_argument("--align", type=int, default=None, help="round the FFN width to a multiple of this")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=0, help="torch / quantiser threads (default: all cores)")
    p.add_argument("--cache-dir", default=None, help="where calibration statistics are cached")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(args) -> int:
    from ..runtime.locate import resolve_model
    from .pipeline import PruneConfig, prune

    ns = build_parser().parse_args(list(getattr(args, "extra", []) or []))
    source = resolve_model(getattr(args, "model", None))
    cfg = PruneConfig(keep=ns.keep, method=ns.method, heads_keep=ns.heads_keep, recover_steps=ns.recover_steps,
                      calib_windows=ns.calib_windows, seq_len=ns.seq_len, lr=ns.lr, recover_batch=ns.recover_batch, recover_seq_len=ns.recover_seq_len,
                      recover_train=ns.recover_train, recover_code_share=ns.recover_code_share,
                      qat=ns.qat, gate_sparsity=ns.gate_sparsity, align=ns.align, seed=ns.seed,
                      calib_files=tuple(ns.calib_file), threads=ns.threads)
    cfg.validate()
    stem = source.name[:-5] if source.name.endswith(".gguf") else source.name
    out = Path(ns.out) if ns.out else source.with_name(f"{stem}.a3b-{ns.method}-{ns.keep:g}.gguf")
    try:
        res = prune(source, out, cfg, force=ns.force, progress=not ns.quiet, cache_dir=ns.cache_dir)
    except KeyboardInterrupt:
        print(f"a3b prune: interrupted; nothing was written to {out} (calibration statistics and "
              "distillation checkpoints are cached: the same command resumes)", file=sys.stderr)
        return 130
    summary = {"out": str(res.path), "n_ff": res.n_ff, "n_ff_source": res.n_ff_source,
               "keep_actual": res.n_ff / res.n_ff_source, "n_head": res.metadata["n_head"],
               "n_head_source": res.metadata["n_head_source"], "method": cfg.method, "recover_steps": len(res.distill_losses),
               "final_kl": res.metadata["recover.final_kl"], "seconds": res.timings}
    if ns.json:
        print(json.dumps(summary, indent=2))
    else:
        heads = res.metadata["n_head"], res.metadata["n_head_source"]
        print(f"wrote {res.path}: FFN width {res.n_ff}/{res.n_ff_source} ({res.n_ff / res.n_ff_source:.3f}), "
              + (f"query heads {heads[0]}/{heads[1]}, " if heads[0] != heads[1] else "") +
              f"method {cfg.method}, {len(res.distill_losses)} recovery steps, "
              f"{sum(res.timings.values()):.0f} s")
    return 0
