"""Arguments and entry point of `a3b prune`.

cli.py adds these arguments to its `prune` subcommand (`add_arguments`) and calls `run` with the
parsed namespace. Importing this module does not import torch or the pipeline: `a3b --help` and the
other commands build the whole parser without them.
"""
from __future__ import annotations

import argparse
import json
import os
import site
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

from ..runtime.models.gguf_info import inspect_gguf
from ..runtime.models.locate import resolve_model
from .device import DEVICES
from .config import EXPERT_METHODS, GPU_RECOVERY, METHODS, PruneConfig, default_cache_dir, with_device_defaults
from .errors import InvalidRequest

DESCRIPTION = ("A3B FFN pruning of a GGUF: remove the least useful FFN neurons of every layer (llama, qwen2, "
               "qwen3, qwen35, gemma3; statistics from llama.cpp's own evaluation of the quantised file, streamed "
               "in bounded memory), whole experts and expert neurons of mixture-of-experts models (qwen3moe, "
               "qwen35moe; --experts-keep), optionally query heads and recovery by distillation (torch reference: "
               "llama, qwen2, qwen3), and write a smaller GGUF that llama.cpp loads as is. Needs the 'prune' extra "
               "(torch): pip install 'comfyui-a3b[prune]'.")

#: What distillation trains (PruneConfig.validate checks the same two names).
RECOVER_TRAIN = ("all", "ffn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add `a3b prune`'s arguments to `p`; every default comes from PruneConfig."""
    d = PruneConfig()  # one place for the defaults: the CLI, cached_variant and the A3BLoader agree
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="GGUF path or name in $A3B_MODELS (default: the embedded SmolLM2-135M)")
    p.add_argument("--keep", type=float, default=None, metavar="RATIO",
                   help=f"fraction of FFN neurons kept (of a mixture-of-experts model: in every kept expert, 1 with "
                        f"--experts-keep) in every layer, in (0, 1] (default: {d.keep})")
    p.add_argument("--experts-keep", type=float, default=None, metavar="RATIO",
                   help="mixture-of-experts models (qwen3moe, qwen35moe): fraction of the routed experts kept in "
                        "every layer, in (0, 1]; --keep then defaults to 1 and --recover-steps to 0 (default: 1, "
                        "every expert)")
    p.add_argument("--expert-method", choices=EXPERT_METHODS, default=d.expert_method,
                   help="how experts are ranked: reap (router weight x output norm on routed tokens), frequency "
                        "(tokens routed), random (default: %(default)s)")
    p.add_argument("--method", choices=METHODS, default=d.method, help="neuron importance method")
    p.add_argument("--heads-keep", type=float, default=d.heads_keep, metavar="RATIO",
                   help="fraction of the query heads of every KV group kept, in (0, 1]; 1 = no head pruning")
    p.add_argument("--recover-steps", type=int, default=None, metavar="N",
                   help=f"distillation steps after pruning, 0 = none; 0 with --experts-keep or a mixture-of-experts "
                        f"model (default: {d.recover_steps}; {GPU_RECOVERY['recover_steps']} where recovery runs on a "
                        "CUDA GPU)")
    p.add_argument("--out", "-o", default=None, metavar="FILE",
                   help="output GGUF (default: beside the model, named MODEL.a3b-METHOD-KEEP.gguf; for a model inside "
                        "the Python installation, such as the embedded one, or in a folder that cannot be written, "
                        "under the cache folder's prune/out, said when the run starts)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--calib-windows", type=int, default=d.calib_windows, metavar="N", help="calibration windows")
    p.add_argument("--seq-len", type=int, default=d.seq_len, metavar="N", help="tokens per calibration window")
    p.add_argument("--calib-file", action="append", default=[], metavar="FILE",
                   help="calibrate on this text file instead of the built-in standard-library corpus "
                        "(repeatable; default: the built-in corpus)")
    p.add_argument("--calib-dir", action="append", default=[], metavar="DIR",
                   help="calibrate (and recover) on the UTF-8 text files under this folder (repeatable; default: the "
                        "built-in corpus)")
    p.add_argument("--calibration", choices=("auto", "llama", "torch"), default=d.calibration,
                   help="where statistics come from: llama.cpp's evaluation of the GGUF (any supported architecture, "
                        "streamed), the torch reference forward (llama/qwen2/qwen3: sequential a3b, recovery, head "
                        "pruning), or auto: torch where recovery or head pruning needs it, llama.cpp otherwise "
                        "(default: %(default)s)")
    p.add_argument("--device", choices=DEVICES, default=d.device,
                   help="where the torch parts run (recovery, reference statistics, least-squares fits); auto takes "
                        "a CUDA GPU when torch sees one (default: %(default)s)")
    p.add_argument("--n-gpu-layers", type=int, default=d.n_gpu_layers, metavar="N",
                   help="llama.cpp calibration: layers offloaded to the GPU, -1 = all, 0 = CPU only "
                        "(default: %(default)s)")
    p.add_argument("--gram-budget-mb", type=int, default=d.gram_budget_mb, metavar="MB",
                   help="llama.cpp calibration: memory for the Gram matrices (obs, a3b) held at once; the other "
                        "layers' inputs go through files in the cache folder in the same pass, or, where its disk "
                        "lacks the room, through more passes (default: half the size of the model file)")
    p.add_argument("--recover-corpus", choices=("calib", "wide"), default=None,
                   help="recovery text: the calibration corpus, or the wide corpus of everything installed (the "
                        "standard library, every package's sources and documentation, Debian's documentation) "
                        f"(default: {d.recover_corpus}; {GPU_RECOVERY['recover_corpus']} on a CUDA GPU)")
    p.add_argument("--lr", type=float, default=d.lr, help="distillation learning rate")
    p.add_argument("--recover-batch", type=int, default=None, metavar="N",
                   help=f"windows per distillation step (default: {d.recover_batch}; "
                        f"{GPU_RECOVERY['recover_batch']} on a CUDA GPU)")
    p.add_argument("--recover-seq-len", type=int, default=None, metavar="N",
                   help=f"tokens per distillation window (default: {d.recover_seq_len}; "
                        f"{GPU_RECOVERY['recover_seq_len']} on a CUDA GPU)")
    p.add_argument("--recover-train", choices=RECOVER_TRAIN, default=d.recover_train,
                   help="tensors distillation trains: every block tensor (all) or only the FFN (ffn)")
    p.add_argument("--recover-code-share", type=float, default=d.recover_code_share, metavar="SHARE",
                   help="share of code windows in distillation batches, the rest prose, in (0, 1)")
    p.add_argument("--no-qat", dest="qat", action="store_false", default=d.qat,
                   help="train in float and quantise once at the end, instead of through llama.cpp's quantiser")
    p.add_argument("--gate-sparsity", type=float, default=d.gate_sparsity, metavar="SHARE",
                   help="target sparsity of the stored dynamic gate, in [0, 1)")
    p.add_argument("--align", type=int, default=d.align, metavar="N",
                   help="round the FFN width to a multiple of N (default: the block size of the file's FFN down "
                        "projections, so that each keeps its type: 32 for Q4_0, Q4_1, Q8_0, 256 for K-quants, 1 for "
                        "float files; a smaller N stores those that cannot hold it in llama-quantize's fallback type)")
    p.add_argument("--seed", type=int, default=d.seed, metavar="N",
                   help="random seed of the run (random selection, distillation batches, dynamic gate)")
    p.add_argument("--threads", type=int, default=d.threads, metavar="N",
                   help="torch / quantiser threads, 0 = all cores")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where calibration statistics and distillation checkpoints are cached "
                        "(default: $A3B_CACHE/prune, else ~/.cache/comfyui-a3b/prune)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def config_from_args(args: argparse.Namespace) -> PruneConfig:
    """The checked PruneConfig the parsed arguments describe.

    With --experts-keep the neuron ratio and recovery default to off (expert pruning is one-shot and
    removes whole experts); recovery left at its defaults takes config.GPU_RECOVERY's where it runs on
    a CUDA GPU. The resolved values are written back to `args` for the output's name.
    """
    d = PruneConfig()
    experts = getattr(args, "experts_keep", None) is not None
    if args.keep is None:
        args.keep = 1.0 if experts else d.keep
    if args.recover_steps is None and experts:
        args.recover_steps = 0
    recovery = with_device_defaults({**{k: getattr(args, k) for k in GPU_RECOVERY}, "device": args.device,
                                     "keep": args.keep, "heads_keep": args.heads_keep})
    for k in GPU_RECOVERY:
        setattr(args, k, recovery[k] if recovery[k] is not None else getattr(d, k))
    cfg = PruneConfig(keep=args.keep, method=args.method, heads_keep=args.heads_keep,
                      recover_steps=args.recover_steps, calib_windows=args.calib_windows, seq_len=args.seq_len,
                      lr=args.lr, recover_batch=args.recover_batch, recover_seq_len=args.recover_seq_len,
                      recover_train=args.recover_train, recover_code_share=args.recover_code_share,
                      qat=args.qat, gate_sparsity=args.gate_sparsity, align=args.align, seed=args.seed,
                      calib_files=tuple(args.calib_file), calib_dirs=tuple(args.calib_dir), threads=args.threads,
                      calibration=args.calibration, device=args.device, n_gpu_layers=args.n_gpu_layers,
                      gram_budget_mb=args.gram_budget_mb, recover_corpus=args.recover_corpus,
                      experts_keep=args.experts_keep if experts else d.experts_keep,
                      expert_method=args.expert_method)
    cfg.validate()
    return cfg


def output_path(source: Path, args: argparse.Namespace) -> tuple[Path, str | None]:
    """--out, or a name beside the source, and a note to print when that name is not where the user
    would look; its folder must exist.

    A source inside the Python installation (the embedded model ships in a package) or in a folder this
    user cannot write gets its output under the cache folder instead: a package's folder is replaced
    or removed with the package, and is no place for the user's files. Checked before any work: the
    file is written only at the end, minutes into a run.
    """
    stem = source.name.removesuffix(".gguf")
    experts = f"e{args.expert_method}-{args.experts_keep:g}-" if getattr(args, "experts_keep", None) is not None else ""
    name = f"{stem}.a3b-{experts}{args.method}-{args.keep:g}.gguf"
    note = None
    if args.out:
        out = Path(args.out)
    elif _inside_python(source) or not os.access(source.parent, os.W_OK):
        out = default_cache_dir() / "out" / name
        out.parent.mkdir(parents=True, exist_ok=True)
        where = "inside the Python installation" if _inside_python(source) else "in a folder this user cannot write"
        note = f"a3b prune: {source.name} is {where}; the pruned file goes to {out} (--out chooses another place)"
    else:
        out = source.with_name(name)
    if not out.parent.is_dir():
        raise InvalidRequest(f"The folder of --out {out} does not exist; create it or choose another --out.")
    return out, note


def _inside_python(path: Path) -> bool:
    """Whether `path` lies in the Python installation: its standard library or any site-packages."""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= set(getattr(site, "getsitepackages", list)()) | {site.getusersitepackages()}
    p = Path(path).resolve()
    return any(part in ("site-packages", "dist-packages") for part in p.parts) or any(
        p.is_relative_to(Path(r).resolve()) for r in roots if r)


def run(args: argparse.Namespace) -> int:
    """Run `a3b prune` with the namespace `add_arguments` describes."""
    source = resolve_model(args.model)
    recovery_default = args.recover_steps is None
    cfg = config_from_args(args)
    out, note = output_path(source, args)
    if note:
        print(note, file=sys.stderr)
    if recovery_default and cfg.recover_steps:
        if inspect_gguf(source).expert_count:  # mixture-of-experts pruning is one-shot
            cfg = replace(cfg, recover_steps=0)
    # Imported after the checks, so that a mistake is reported before the heavy imports.
    from .dense.distill import notifier
    from .pipeline import prune

    try:
        res = prune(source, out, cfg, force=args.force, progress=not args.quiet, cache_dir=args.cache_dir,
                    notify=notifier(not args.quiet, lambda m: print(m, file=sys.stderr)))
    except KeyboardInterrupt:
        print(f"a3b prune: interrupted; nothing was written to {out} (calibration statistics and "
              "distillation checkpoints are cached: the same command resumes)", file=sys.stderr)
        return 130
    print_result(res, cfg, as_json=args.json)
    return 0


def print_result(res, cfg: PruneConfig, *, as_json: bool) -> None:
    summary = {"out": str(res.path), "n_ff": res.n_ff, "n_ff_source": res.n_ff_source,
               "keep_actual": res.n_ff / res.n_ff_source, "n_head": res.metadata["n_head"],
               "n_head_source": res.metadata["n_head_source"], "method": cfg.method,
               "recover_steps": len(res.distill_losses), "final_kl": res.metadata["recover.final_kl"],
               "seconds": res.timings}
    m = res.metadata
    if "n_expert" in m:
        summary.update({"n_expert": m["n_expert"], "n_expert_source": m["n_expert_source"],
                        "n_expert_used": m["n_expert_used"], "expert_method": m["experts.method"]})
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    if "n_expert" in m:
        print(f"wrote {res.path}: experts {m['n_expert']}/{m['n_expert_source']} per layer "
              f"({m['experts.method']}), {m['n_expert_used']} used per token, expert FFN width "
              f"{res.n_ff}/{res.n_ff_source} ({cfg.method}), {sum(res.timings.values()):.0f} s")
        return
    heads = res.metadata["n_head"], res.metadata["n_head_source"]
    print(f"wrote {res.path}: FFN width {res.n_ff}/{res.n_ff_source} ({res.n_ff / res.n_ff_source:.3f}), "
          + (f"query heads {heads[0]}/{heads[1]}, " if heads[0] != heads[1] else "") +
          f"method {cfg.method}, {len(res.distill_losses)} recovery steps, "
          f"{sum(res.timings.values()):.0f} s")
