"""How far recovery goes: held-out perplexity of an a3b-pruned model against distillation steps.

    python -m comfyui_a3b.bench.bench_recovery --keep 0.63 --steps 0,40,80,160
    python -m comfyui_a3b.bench.bench_recovery --keep 0.63 --steps 160 --recover-corpus wide --name bench_recovery_wide

Every point is the variant the A3BLoader would serve (`cached_variant`, made once and kept in the
variant cache, so points made earlier, e.g. by bench_prune, are measured without training again).
Perplexity is llama.cpp's, on the quantised files, as a ratio to the unpruned file measured in the
same run, over four held-out sets: standard-library code modules, whole installed packages, language
reference topics (the same source as the calibration prose) and manual pages (prose from a source
neither calibration nor recovery reads). `--recover-corpus wide` distils on the wide corpus of
installed sources and documentation (wide.wide_corpus) instead of the calibration corpus.
Writes bench/results/<name>.{json,png}.
"""
from __future__ import annotations

import time

from .common import arguments, model_option, model_path, name_option, plot, print_table, write_results
from .evaluate import LlamaEval


def torch_device(asked: str) -> str:
    """What distillation ran on, in words (auto resolves to the GPU where torch sees one)."""
    if asked == "cpu":
        return "CPU"
    try:
        import torch
    except ImportError:
        return "no torch"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def main(argv=None) -> int:
    from ..prune.config import PruneConfig
    from ..prune.device import DEVICES

    d = PruneConfig()  # the recovery `a3b prune` and the A3BLoader use, unless told otherwise
    ap = arguments(__doc__)
    ap.add_argument("--keep", type=float, default=0.63)
    ap.add_argument("--method", default="a3b")
    ap.add_argument("--steps", default="0,40,80,160", help="distillation step counts (comma list)")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--batch", type=int, default=d.recover_batch)
    ap.add_argument("--seq-len", type=int, default=d.recover_seq_len, help="tokens per distillation window")
    ap.add_argument("--heldout-windows", type=int, default=16, help="windows of 256 tokens per held-out corpus")
    ap.add_argument("--recover-corpus", choices=("calib", "wide"), default=d.recover_corpus)
    ap.add_argument("--keeps", default=None, help="several keep ratios (comma list) instead of --keep")
    name_option(ap, "bench_recovery")
    model_option(ap, help="the source GGUF (llama/qwen2/qwen3; default: the embedded model)")
    ap.add_argument("--device", choices=DEVICES, default=d.device,
                    help="where distillation runs (auto: the GPU when torch sees one)")
    args = ap.parse_args(argv)
    from .bench_prune_llama import heldout

    base = model_path(args.model)
    with LlamaEval(base, n_ctx=256) as ev:
        H = heldout(ev, args.heldout_windows, 256)
        base_ppl = {k: ev.perplexity(v) for k, v in H.items()}
    points = []
    keeps = [float(k) for k in args.keeps.split(",")] if args.keeps else [args.keep]
    for keep, steps in [(k, int(s)) for k in keeps for s in args.steps.split(",") if s]:
        points.append(point(base, keep, steps, H, base_ppl, args))
        got = ", ".join(f"{k} x{v:.3f}" for k, v in points[-1]["ppl_ratio"].items())
        print(f"keep {keep:g}, {steps} steps: {got}", flush=True)
        write_results(args.name, {"model": base.name, "settings": vars(args), "torch_device": torch_device(args.device),
                                  "base_perplexity": base_ppl,
                                  "heldout_tokens": {k: sum(len(w) for w in v) for k, v in H.items()},
                                  "points": points})
    report(points, keeps, H, base.name, args)
    return 0


def point(base, keep: float, steps: int, H: dict, base_ppl: dict, args) -> dict:
    """The variant at `keep` recovered for `steps` (from the variant cache, made if missing), measured."""
    from ..prune import cached_variant
    from ..runtime import inspect_gguf

    t0 = time.perf_counter()
    path = cached_variant(base, keep=keep, method=args.method, recover_steps=steps, lr=args.lr,
                          recover_batch=args.batch, recover_seq_len=args.seq_len, progress=True,
                          recover_corpus=args.recover_corpus, device=args.device)
    made_s = time.perf_counter() - t0
    meta = inspect_gguf(path).a3b
    with LlamaEval(path, n_ctx=256) as ev:
        ppl = {k: ev.perplexity(v) for k, v in H.items()}
    return {"keep": keep, "steps": steps, "tokens": int(meta.get("a3b.recover.tokens", 0)),
            "final_kl": float(meta.get("a3b.recover.final_kl", 0.0)),
            "kind": meta.get("a3b.recover.kind", "none"), "perplexity": ppl,
            "ppl_ratio": {k: ppl[k] / base_ppl[k] for k in ppl}, "seconds_to_get": made_s}


def report(points: list[dict], keeps: list[float], H: dict, model: str, args) -> None:
    print_table(f"{args.method}, recovery on the {args.recover_corpus} corpus: held-out perplexity vs the unpruned "
                "file (" + ", ".join(f"{k} {sum(len(w) for w in v)}" for k, v in H.items()) + " tokens)",
                ["keep", "steps", "tokens", "final KL", *(f"ppl {k} x" for k in H)],
                [[p["keep"], p["steps"], p["tokens"], p["final_kl"], *(p["ppl_ratio"][k] for k in H)]
                 for p in points])

    def draw(ax):
        for i, keep in enumerate(keeps):
            pts = [p for p in points if p["keep"] == keep]
            xs = [p["steps"] for p in pts]
            for j, k in enumerate(H):
                ax.plot(xs, [p["ppl_ratio"][k] for p in pts], "os^v"[j] + "-", color=f"C{j}", alpha=1 - 0.4 * i,
                        label=f"keep {keep:g}, held-out {k}")
        ax.axhline(1.10, color="grey", lw=0.6, ls=":", label="target at keep 0.63 (1.10)")
        ax.axhline(1.03, color="grey", lw=0.6, ls="--", label="target at keep 0.8 (1.03)")
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_xlabel(f"distillation steps ({args.batch} x {args.seq_len} tokens each)")
        ax.set_ylabel("perplexity ratio vs unpruned")
        ax.set_title(f"recovery of {args.method} on the {args.recover_corpus} corpus, {model}")
        ax.legend(fontsize=6)

    plot(args.name, draw, size=(7, 4.5))


if __name__ == "__main__":
    raise SystemExit(main())
