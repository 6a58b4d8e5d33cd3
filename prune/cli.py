"""Arguments and entry point of `a3b prune`.

cli.py adds these arguments to its `prune` subcommand (`add_arguments`) and calls `run` with the
parsed namespace. Every pruning flag is a declaration of settings.py (name, type, default, choices,
help); this module adds only how a flag is shown. Importing it does not import torch or the
pipeline: `a3b --help` and the other commands build the whole parser without them.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from ..runtime.models.locate import resolve_model
from ..runtime.options import Option, add_argument, cli_help
from .config import PruneConfig, with_device_defaults
from .output import output_path, print_result
from .settings import BY_NAME, GPU_RECOVERY, OPTIONS, recover_steps_for

__all__ = ["DESCRIPTION", "add_arguments", "config_from_args", "output_path", "run"]

DESCRIPTION = ("A3B FFN pruning of a GGUF: remove the least useful FFN neurons of every layer (llama, qwen2, "
               "qwen3, qwen35, gemma3; statistics from llama.cpp's own evaluation of the quantised file, streamed "
               "in bounded memory), whole experts and expert neurons of mixture-of-experts models (qwen3moe, "
               "qwen35moe; --experts-keep), optionally query heads and recovery by distillation (torch reference: "
               "llama, qwen2, qwen3), and write a smaller GGUF that llama.cpp loads as is. Needs the 'prune' extra "
               "(torch): pip install 'comfyui-a3b[prune]'.")

#: Settings a caller of the pipeline sets, not the command line.
NOT_FLAGS = ("gate_windows",)


_N = {"metavar": "N"}
#: How each flag shows beyond its declaration: a metavar, another flag name, and for a setting whose
#: default follows from other settings (None when not given) the words for its default.
SHOWN: dict[str, dict] = {
    "keep": {"metavar": "RATIO", "default": None, "default_text": f"{BY_NAME['keep'].default}"},
    "experts_keep": {"metavar": "RATIO", "default": None, "default_text": "1, every expert"},
    "heads_keep": {"metavar": "RATIO"},
    "recover_steps": {"metavar": "N", "default": None, "default_text": f"{BY_NAME['recover_steps'].default}; "
                      f"{GPU_RECOVERY['recover_steps']} where recovery runs on a CUDA GPU"},
    "calib_windows": _N, "seq_len": _N, "n_gpu_layers": _N, "align": _N, "seed": _N, "threads": _N,
    "calib_files": {"flags": ("--calib-file",), "metavar": "FILE", "action": "append", "type": str, "default": []},
    "calib_dirs": {"flags": ("--calib-dir",), "metavar": "DIR", "action": "append", "type": str, "default": []},
    "gram_budget_mb": {"metavar": "MB"},
    **{k: {"default": None, "default_text": f"{BY_NAME[k].default}; {GPU_RECOVERY[k]} on a CUDA GPU",
           **({"metavar": "N"} if k != "recover_corpus" else {})}
       for k in ("recover_corpus", "recover_batch", "recover_seq_len")},
    "recover_code_share": {"metavar": "SHARE"},
    "gate_sparsity": {"metavar": "SHARE"},
    "qat": {"flags": ("--no-qat",), "action": "store_false",
            "help": "train in float and quantise once at the end, instead of through llama.cpp's quantiser"},
}


def _help(option: Option, default_text: str | None) -> str:
    """The flag's help: the declaration's, its range where it has two bounds, then the default in words."""
    text = cli_help(option.help)
    if option.type is float and option.min is not None and option.max is not None:
        text += f", {option.range_text()}"
    return text + (f" (default: {default_text})" if default_text else "")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add `a3b prune`'s arguments to `p`: one flag per declared setting (settings.py), then the run's own."""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="GGUF path or name in $A3B_MODELS (default: the embedded SmolLM2-135M)")
    for option in OPTIONS:
        if option.name in NOT_FLAGS:
            continue
        kw = dict(SHOWN.get(option.name, {}))
        flags = kw.pop("flags", ())
        kw.setdefault("help", _help(option, kw.pop("default_text", None)))
        add_argument(p, option, *flags, dest=option.name, **kw)
    p.add_argument("--out", "-o", default=None, metavar="FILE",
                   help="output GGUF (default: beside the model, named MODEL.a3b-METHOD-KEEP.gguf; for a model inside "
                        "the Python installation, such as the embedded one, or in a folder that cannot be written, "
                        "under the cache folder's prune/out, said when the run starts)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where calibration statistics and distillation checkpoints are cached "
                        "(default: $A3B_CACHE/prune, else ~/.cache/comfyui-a3b/prune)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def config_from_args(args: argparse.Namespace, source=None) -> PruneConfig:
    """The checked PruneConfig the parsed arguments describe, for the model file `source` (None: not read).

    With --experts-keep the neuron ratio defaults to 1 (written back to `args` for the output's
    name); recovery follows settings.recover_steps_for (expert pruning, or a mixture-of-experts
    `source`, is one-shot); recovery left at its defaults takes config.GPU_RECOVERY's where it runs
    on a CUDA GPU. Every setting as given is checked before `source` is read.
    """
    experts = args.experts_keep is not None
    if args.keep is None:
        args.keep = 1.0 if experts else BY_NAME["keep"].default
    given = {f.name: getattr(args, f.name) for f in fields(PruneConfig) if f.name not in NOT_FLAGS}
    given.update(calib_files=tuple(args.calib_files), calib_dirs=tuple(args.calib_dirs),
                 experts_keep=args.experts_keep if experts else BY_NAME["experts_keep"].default)
    PruneConfig(**{**given, **{k: BY_NAME[k].default for k in GPU_RECOVERY if given[k] is None}}).validate()
    given["recover_steps"] = recover_steps_for(args.recover_steps, experts_keep=given["experts_keep"], source=source)
    recovery = with_device_defaults(given)
    cfg = PruneConfig(**{**given, **{k: BY_NAME[k].default if recovery[k] is None else recovery[k]
                                     for k in GPU_RECOVERY}})
    cfg.validate()
    return cfg


def run(args: argparse.Namespace) -> int:
    """Run `a3b prune` with the namespace `add_arguments` describes."""
    source = resolve_model(args.model)
    config_from_args(args)   # every setting checked, and the output's folder, before the model is read
    out, note = output_path(source, args)
    if note:
        print(note, file=sys.stderr)
    cfg = config_from_args(args, source)
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
