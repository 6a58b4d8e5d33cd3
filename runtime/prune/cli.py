"""`a3b prune MODEL --keep 0.63 --method a3b --recover-steps 200 --out FILE` (flags parsed here)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .methods import METHODS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="a3b prune", description="A3B gated-FFN pruning of a llama/qwen2/qwen3 GGUF.")
    p.add_argument("--keep", type=float, default=0.63, help="fraction of FFN neurons kept in every layer, in (0, 1]")
    p.add_argument("--method", choices=METHODS, default="a3b", help="neuron importance method (default a3b)")
    p.add_argument("--recover-steps", type=int, default=40, help="distillation steps after pruning (0 = none)")
    p.add_argument("--out", "-o", default=None, help="output GGUF (default: beside the model, *.a3b-<method>-<keep>.gguf)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--calib-windows", type=int, default=64, help="calibration windows (default 64)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window (default 256)")
    p.add_argument("--calib-file", action="append", default=[], help="calibrate on this text file instead of the "
                   "built-in standard-library corpus (repeatable)")
    p.add_argument("--lr", type=float, default=5e-4, help="distillation learning rate (default 5e-4)")
    p.add_argument("--recover-batch", type=int, default=8, help="windows of 128 tokens per distillation step (default 8)")
    p.add_argument("--recover-train", choices=("all", "ffn"), default="all",
                   help="tensors distillation trains: every block tensor (default) or only the FFN")
    p.add_argument("--recover-code-share", type=float, default=0.5,
                   help="share of code windows in distillation batches, the rest prose (default 0.5)")
    p.add_argument("--no-qat", dest="qat", action="store_false",
                   help="train in float and quantise once at the end, instead of through llama.cpp's quantiser")
    p.add_argument("--gate-sparsity", type=float, default=0.5, help="target sparsity of the stored dynamic gate")
    p.add_argument("--align", type=int, default=None, help="round the FFN width to a multiple of this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch / quantiser threads (default: all cores)")
    p.add_argument("--cache-dir", default=None, help="where calibration statistics are cached")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(args) -> int:
    from ..locate import resolve_model
    from .pipeline import PruneConfig, prune

    ns = build_parser().parse_args(list(getattr(args, "extra", []) or []))
    source = resolve_model(getattr(args, "model", None))
    cfg = PruneConfig(keep=ns.keep, method=ns.method, recover_steps=ns.recover_steps, calib_windows=ns.calib_windows,
                      seq_len=ns.seq_len, lr=ns.lr, recover_batch=ns.recover_batch,
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
               "keep_actual": res.n_ff / res.n_ff_source, "method": cfg.method, "recover_steps": len(res.distill_losses),
               "final_kl": res.metadata["recover.final_kl"], "seconds": res.timings}
    if ns.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"wrote {res.path}: FFN width {res.n_ff}/{res.n_ff_source} ({res.n_ff / res.n_ff_source:.3f}), "
              f"method {cfg.method}, {len(res.distill_losses)} recovery steps, "
              f"{sum(res.timings.values()):.0f} s")
    return 0
