"""`a3b tune` on a real package: held-out perplexity, next-line exact match, prose, training speed.

    python -m comfyui_a3b.bench.bench_tune                        # markdown_it from site-packages, ~12 minutes
    python -m comfyui_a3b.bench.bench_tune --package cattrs --steps 80 --eval-every 40

The embedded model (SmolLM2-135M) is tuned on the sources of one installed package the tests do not
use (default markdown_it: 66 files, 240 KB), split by whole file as `a3b tune` splits it, with the
command's own code (tune/run.py) and the options given here. Then, before (base) and after (the
adapter), in the same run:

* held-out perplexity on the package's held-out files (the tuner's held-out samples; target: the
  adapter's at most 0.85 of the base's);
* perplexity on unrelated prose: the long descriptions of other installed distributions (their
  METADATA), which the adapter never saw (target: at most 1.05 of the base's). Both perplexities
  are the torch reference forward's, with and without the LoRA; the slow test checks that llama.cpp
  computes the same logits with the adapter loaded;
* next-line exact match through the language server's completion path (bench/nextline.py): at
  seeded lines of the held-out files, the line emptied to its indentation with the cursor there, the
  server's prompt and post-processing, base and adapter over the same loaded weights (one model, a
  context each); a hit is the suggestion's first line right. Reported as counts with 95% intervals
  and the lines only one side gets right (a paired sign test);
* training tokens/s on this machine.

Writes bench/results/bench_tune.{json,png}.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import arguments, name_option, plot, print_table, write_results


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"no installed package {name!r}")
    return Path(list(spec.submodule_search_locations)[0])


def prose_texts(exclude: str, n: int, seed: int) -> list[tuple[str, str]]:
    from importlib.metadata import distributions

    texts = {}
    for d in distributions():
        name = (d.metadata.get("Name") or "").lower()
        body = d.metadata.get_payload() if hasattr(d.metadata, "get_payload") else None
        body = body or d.metadata.get("Description") or ""
        if name and exclude not in name.replace("-", "_") and len(body) > 3000:
            texts[name] = body
    names = sorted(texts)
    random.Random(seed).shuffle(names)
    return [(k, texts[k][:12000]) for k in names[:n]]


def options() -> argparse.ArgumentParser:
    from ..lsp_server.config import CONTEXT_TOKENS
    from ..tune import options as o

    ap = arguments(__doc__)
    ap.add_argument("--package", default="markdown_it")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seq-len", type=int, default=384,
                    help="sample length; the server's prompts carry up to context_tokens "
                         f"({CONTEXT_TOKENS.default}) tokens of the file")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=o.RANK.default)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-samples", type=int, default=24, help="held-out samples evaluated (a seeded choice)")
    ap.add_argument("--lines", type=int, default=400, help="next-line cases")
    ap.add_argument("--fim-rate", type=float, default=o.FIM_RATE.default,
                    help="share of samples in the editor's layout (0: plain windows only)")
    ap.add_argument("--docstring-pairs", action="store_true", help="add docstring -> body pairs")
    ap.add_argument("--prose", type=int, default=4, help="prose texts")
    ap.add_argument("--prose-rows", type=int, default=16, help="prose windows evaluated (a seeded choice)")
    name_option(ap, "bench_tune")
    ap.add_argument("--out", default=None, help="the adapter (default: a temporary file)")
    return ap


def tuned(args, root: Path, base: Path, out: Path):
    """`a3b tune`'s own run (tune/run.py) with the options given: (its result, its config, seconds)."""
    from ..tune import options as o
    from ..tune.run import tune

    cfg = o.TuneConfig(steps=args.steps, seq_len=args.seq_len, batch=args.batch, lr=args.lr, rank=args.rank,
                       alpha=2.0 * args.rank, eval_every=args.eval_every, patience=0, device="cpu",
                       fim_rate=args.fim_rate, docstring_pairs=args.docstring_pairs)
    print(f"tuning {base.name} on {root} ({args.steps} steps of {args.batch} x {args.seq_len} tokens)", flush=True)
    t0 = time.perf_counter()
    r = tune(root, base, out, cfg, resume=False, max_eval_samples=args.eval_samples)
    tune_s = time.perf_counter() - t0
    print(f"held-out loss {r.heldout_loss_base:.4f} -> {r.heldout_loss:.4f} (x{r.ratio:.3f} perplexity)", flush=True)
    return r, cfg, tune_s


def prose_losses(args, cfg, base: Path, tensors) -> dict:
    """Loss on unrelated prose with and without the adapter (the torch forward; the adapter's
    `tensors` as read back from its file)."""
    from ..prune.source import SourceModel
    from ..runtime.llama.weights import Weights
    from ..tune.lora import Adapted
    from ..tune.model import load_base
    from ..tune.samples import Builder, Tokenizer
    from ..tune.train import evaluate

    model = Adapted(load_base(SourceModel(base), "cpu"), cfg.target_list, cfg.rank, cfg.alpha, 0.0)
    model.load_tensors(tensors)
    vocab = Weights(base, vocab_only=True)
    try:
        prose = Builder(Tokenizer.from_vocab(vocab), args.seq_len, 0.0).build(
            [_as_file(n, t) for n, t in prose_texts(args.package, args.prose, 0)])
    finally:
        vocab.free()
    if len(prose) > args.prose_rows:
        keep = np.sort(np.random.default_rng(0).choice(len(prose), args.prose_rows, replace=False))
        prose = type(prose)(prose.tokens[keep], prose.weights[keep], [prose.kinds[i] for i in keep])
    prose_tuned = evaluate(model, prose, args.batch, "cpu")
    model.detach()
    prose_base = evaluate(model, prose, args.batch, "cpu")
    prose_ratio = math.exp(prose_tuned - prose_base)
    print(f"prose loss {prose_base:.4f} -> {prose_tuned:.4f} (x{prose_ratio:.3f} perplexity)", flush=True)
    return {"prose_loss_base": prose_base, "prose_loss": prose_tuned, "prose_ratio": prose_ratio,
            "prose_rows": len(prose)}


def next_lines(args, cfg, root: Path, base: Path, out: Path) -> dict:
    """Next-line exact match through the server's completion path: one loaded model, a context with
    and one without the adapter."""
    from ..lsp_server.config import Settings
    from ..runtime import get_runtime
    from ..tune.collect import collect, split
    from . import nextline

    parts = split(collect(root, cfg.max_file_kb * 1024).files, cfg.holdout, cfg.seed)
    picked = nextline.cases(parts.heldout, args.lines, 0)
    rt = get_runtime()
    settings = Settings()
    n_ctx = 1024
    plain = rt.spec(base, n_ctx=n_ctx, n_parallel=1)
    with_adapter = rt.spec(base, n_ctx=n_ctx, n_parallel=1, lora_path=str(out))
    t1 = time.perf_counter()
    said_base: list[str] = []
    said_tuned: list[str] = []
    hits_base = nextline.run(rt, plain, parts.heldout, picked, settings, said_base)
    hits_tuned = nextline.run(rt, with_adapter, parts.heldout, picked, settings, said_tuned)
    nl = nextline.compare(hits_base, hits_tuned)
    # the lines only one side got right, with what the other said there
    apart = [{"file": parts.heldout[fi].path, "line": i + 1, "base": b, "adapter": t,
              "right": "adapter" if ht else "base"}
             for (fi, i), b, t, hb, ht in zip(picked, said_base, said_tuned, hits_base, hits_tuned) if hb != ht]
    em_base, em_tuned = nl["base_hits"] / max(nl["cases"], 1), nl["tuned_hits"] / max(nl["cases"], 1)
    loads = rt.store.weight_loads
    print(f"next-line exact match {nl['base_hits']}/{nl['cases']} -> {nl['tuned_hits']}/{nl['cases']} "
          f"(95% {nl['base_ci95'][0]:.3f}-{nl['base_ci95'][1]:.3f} -> {nl['tuned_ci95'][0]:.3f}-"
          f"{nl['tuned_ci95'][1]:.3f}); right only with the base {nl['only_base']}, only with the adapter "
          f"{nl['only_tuned']} (sign test p={nl['sign_test_p']:.3g}); {time.perf_counter() - t1:.0f} s, "
          f"weights loaded {loads} time(s)", flush=True)
    return {"next_line_cases": nl["cases"], "next_line": nl, "exact_match_base": em_base,
            "exact_match_tuned": em_tuned, "weight_loads": loads, "next_line_apart": apart}


def report(data: dict, name: str) -> None:
    package, ratio, prose_ratio = data["package"], data["perplexity_ratio"], data["prose_ratio"]
    em_base, em_tuned = data["exact_match_base"], data["exact_match_tuned"]
    rows = [("held-out perplexity (package)", math.exp(data["heldout_loss_base"]), math.exp(data["heldout_loss"]),
             ratio, "<= 0.85"),
            ("prose perplexity", math.exp(data["prose_loss_base"]), math.exp(data["prose_loss"]), prose_ratio,
             "<= 1.05"),
            ("next-line exact match", em_base, em_tuned, em_tuned - em_base, "> 0 (difference)")]
    print_table(f"a3b tune on {package}: base vs adapter", ("measure", "base", "adapter", "ratio", "target"), rows)
    print(f"training: {data['train_tokens']} tokens in {data['train_seconds']:.0f} s = "
          f"{data['train_tokens_per_s']:.0f} tokens/s; whole command {data['command_seconds']:.0f} s")

    def draw(ax):
        xs = np.arange(3)
        ax.bar(xs - 0.2, [1.0, 1.0, em_base], 0.4, label="base")
        ax.bar(xs + 0.2, [ratio, prose_ratio, em_tuned], 0.4, label="adapter")
        ax.set_xticks(xs, ["package ppl (rel.)", "prose ppl (rel.)", "next-line exact match"])
        ax.axhline(0.85, color="green", linestyle=":", linewidth=1)
        ax.axhline(1.05, color="red", linestyle=":", linewidth=1)
        ax.set_title(f"a3b tune on {package} ({data['steps']} steps, SmolLM2-135M)")
        ax.legend()
    plot(name, draw)


def main(argv=None) -> int:
    from ..runtime.models.locate import resolve_model
    from ..tune import adapter

    args = options().parse_args(argv)
    root = package_dir(args.package)
    base = Path(resolve_model(None))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or Path(tmp) / f"{args.package}.lora.gguf")
        r, cfg, tune_s = tuned(args, root, base, out)
        meta, tensors = adapter.read(out)
        prose = prose_losses(args, cfg, base, tensors)
        lines = next_lines(args, cfg, root, base, out)
        data = {"package": args.package, "root": str(root), "config": cfg.as_dict(),
                "files": r.train_files + r.heldout_files,
                "heldout_files": r.heldout_files, "heldout_loss_base": r.heldout_loss_base,
                "heldout_loss": r.heldout_loss, "perplexity_ratio": r.ratio, **prose,
                **{k: lines[k] for k in ("next_line_cases", "next_line", "exact_match_base", "exact_match_tuned",
                                         "weight_loads")},
                "train_tokens": r.tokens, "train_seconds": r.seconds,
                "train_tokens_per_s": r.tokens / max(r.seconds, 1e-9), "command_seconds": tune_s,
                "next_line_apart": lines["next_line_apart"], "steps": r.steps,
                "best_step": r.best_step, "evals": meta.get("a3b.tune.heldout_loss"),
                "adapter_bytes": out.stat().st_size, "samples": meta.get("a3b.tune.samples")}
    write_results(args.name, data)
    report(data, args.name)
    return 0


def _as_file(name: str, text: str):
    from ..tune.collect import SourceFile

    return SourceFile(name, "prose", text)


if __name__ == "__main__":
    raise SystemExit(main())
