"""`a3b tune`'s arguments (from the Options in options.py) and the command itself.

Importing this module imports neither torch nor the training code; `run` does, when the command runs.
With `--progress-json` the command prints one JSON object a line on standard output (steps, losses,
the result), which the language server's tune command reads.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..runtime.options import add_argument, cli_help
from . import options as o

DESCRIPTION = ("Train a LoRA adapter on a repository's code and write it as a GGUF LoRA adapter that llama.cpp loads "
               "over the same base model (a3b generate/serve --lora, the A3BLoader's lora, the editor's lora "
               "setting). Source files are split by whole file into training and held-out files; training stops "
               "early when the held-out loss stops improving, Ctrl-C keeps the best adapter so far, and a run "
               "started again resumes. Needs the 'prune' extra (torch).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="the repository's folder (its .gitignore is honoured)")
    p.add_argument("--model", "-m", default=None,
                   help="the base GGUF the adapter is for: a path or a name in the model folders "
                        "(default: the embedded SmolLM2-135M)")
    p.add_argument("--out", "-o", default=None, metavar="ADAPTER.gguf",
                   help="where the adapter goes (default: DIR-NAME.MODEL.lora.gguf in the current folder)")
    for opt in o.OPTIONS:
        if opt.type is bool:   # a switch: off unless given
            p.add_argument("--" + opt.name.replace("_", "-"), action="store_true", help=cli_help(opt.help))
        elif opt is o.STEPS:
            add_argument(p, opt, metavar="N", default_text="--epochs passes")
        else:
            add_argument(p, opt)
    p.add_argument("--restart", action="store_true", help="ignore a checkpoint of an earlier run of the same settings")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument("--progress-json", action="store_true",
                   help="print progress and the result as JSON lines on stdout (for editors)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def config(args) -> o.TuneConfig:
    return o.TuneConfig(**{opt.name: getattr(args, opt.name) for opt in o.OPTIONS})


def summary(r) -> str:
    return (f"wrote {r.adapter}: held-out loss {r.heldout_loss_base:.4f} -> {r.heldout_loss:.4f} (perplexity "
            f"x{r.ratio:.3f}) after {r.steps} steps, best at step {r.best_step} ({r.stopped}); {r.train_files} "
            f"training and {r.heldout_files} held-out files, {r.tokens} tokens in {r.seconds:.0f} s")


def result_json(r) -> dict:
    return {"adapter": str(r.adapter), "heldout_loss_base": r.heldout_loss_base, "heldout_loss": r.heldout_loss,
            "perplexity_ratio": r.ratio, "steps": r.steps, "best_step": r.best_step, "stopped": r.stopped,
            "tokens": r.tokens, "seconds": r.seconds, "train_files": r.train_files, "heldout_files": r.heldout_files}


def run(args) -> int:
    cfg = config(args)   # bad values are refused before anything is loaded
    from .run import tune

    def progress(ev: dict) -> None:
        print(json.dumps(ev), flush=True)

    r = tune(args.dir, args.model, args.out, cfg, resume=not args.restart,
             bar=not (args.quiet or args.progress_json), progress=progress if args.progress_json else None)
    if args.progress_json or args.json:
        print(json.dumps({"result": result_json(r)}), flush=True)
    else:
        print(summary(r))
    if r.stopped == "interrupted":
        print("a3b: interrupted: the best adapter so far was written; run the same command again to resume",
              file=sys.stderr)
        return 130
    return 0
