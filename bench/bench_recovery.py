"""How far recovery goes: held-out perplexity of an a3b-pruned model against distillation steps.

    python -m comfyui_a3b.bench.bench_recovery --keep 0.63 --steps 0,40,80,160

Every point is the variant the A3BLoader would serve (`cached_variant`, made once and kept in the
variant cache, so points made earlier, e.g. by bench_prune, are measured without training again).
Perplexity is llama.cpp's, on the quantised files, over held-out code and prose windows, as a ratio
to the unpruned file measured in the same run. Writes bench/results/bench_recovery.{json,png}.
"""
from __future__ import annotations

import argparse
import time

from .common import plot, print_table, write_results


def main(argv=None) -> int:
    from ..prune.pipeline import PruneConfig

    d = PruneConfig()  # the recovery `a3b prune` and the A3BLoader use, unless told otherwise
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=float, default=0.63)
    ap.add_argument("--method", default="a3b")
    ap.add_argument("--steps", default="0,40,80,160", help="distillation step counts (comma list)")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--batch", type=int, default=d.recover_batch)
    ap.add_argument("--seq-len", type=int, default=d.recover_seq_len, help="tokens per distillation window")
    ap.add_argument("--heldout-windows", type=int, default=16, help="windows of 256 tokens per held-out corpus")
    args = ap.parse_args(argv)

    from ..runtime import default_model_path, inspect_gguf
    from ..prune import cached_variant
    from ..prune.llama_eval import LlamaEval
    from .bench_prune import heldout_windows

    base = default_model_path()
    with LlamaEval(base, n_ctx=256) as ev:
        H = heldout_windows(ev, args.heldout_windows, 256)
        base_ppl = {k: ev.perplexity(v) for k, v in H.items()}
    points = []
    for steps in [int(s) for s in args.steps.split(",") if s]:
        t0 = time.perf_counter()
        path = cached_variant(base, keep=args.keep, method=args.method, recover_steps=steps, lr=args.lr,
                              recover_batch=args.batch, recover_seq_len=args.seq_len, progress=True)
        made_s = time.perf_counter() - t0
        meta = inspect_gguf(path).a3b
        with LlamaEval(path, n_ctx=256) as ev:
            ppl = {k: ev.perplexity(v) for k, v in H.items()}
        points.append({"steps": steps, "tokens": int(meta.get("a3b.recover.tokens", 0)),
                       "final_kl": float(meta.get("a3b.recover.final_kl", 0.0)),
                       "kind": meta.get("a3b.recover.kind", "none"), "perplexity": ppl,
                       "ppl_ratio": {k: ppl[k] / base_ppl[k] for k in ppl}, "seconds_to_get": made_s})
        print(f"{steps} steps: code x{points[-1]['ppl_ratio']['code']:.3f}, "
              f"prose x{points[-1]['ppl_ratio']['prose']:.3f}")

    print_table(f"{args.method} keep {args.keep:g}: held-out perplexity vs the unpruned file "
                f"({sum(len(w) for w in H['code'])} code + {sum(len(w) for w in H['prose'])} prose tokens)",
                ["steps", "tokens", "final KL", "ppl code x", "ppl prose x"],
                [[p["steps"], p["tokens"], p["final_kl"], p["ppl_ratio"]["code"], p["ppl_ratio"]["prose"]]
                 for p in points])
    write_results("bench_recovery", {"model": base.name, "settings": vars(args), "base_perplexity": base_ppl,
                                     "heldout_tokens": {k: sum(len(w) for w in v) for k, v in H.items()},
                                     "points": points})

    def draw(ax):
        xs = [p["steps"] for p in points]
        for k, style in (("code", "o-"), ("prose", "s-")):
            ax.plot(xs, [p["ppl_ratio"][k] for p in points], style, label=f"held-out {k}")
        ax.axhline(1.10, color="grey", lw=0.6, ls=":", label="target at keep 0.63 (1.10)")
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_xlabel(f"distillation steps ({args.batch} x {args.seq_len} tokens each)")
        ax.set_ylabel("perplexity ratio vs unpruned")
        ax.set_title(f"recovery of {args.method} keep {args.keep:g}, {base.name}")
        ax.legend(fontsize=8)

    plot("bench_recovery", draw, size=(7, 4.5))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
