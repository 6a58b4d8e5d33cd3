"""Expert pruning on tiny random mixture-of-experts models: REAP vs frequency vs random ranking.

    python -m comfyui_a3b.bench.bench_prune_moe --experts-keep 0.5

Run from a source checkout (the models are written by tests/tinygguf.py). Two random-weight qwen3moe
models: "random" (every expert alike) and "planted" (in every layer a quarter of the experts never
routed, with near-zero outputs, and a quarter routed as usual but with outputs scaled down 20x). Each
is pruned to the same expert count with each ranking, calibrated on the built-in corpus (standard
library code and pydoc prose), and compared with its source on held-out text from another source
(manual pages where the machine has them, else held-out standard-library modules): mean KL divergence
of the next-token distribution and top-1 agreement, by llama.cpp on the files. Random ranking is
averaged over three seeds. Random weights say little about real models: this checks that the
rankings do what they say on structure that is known to be there, not how a real MoE model fares
(run its held-out perplexity with bench_prune's commands on your own model for that).
Writes bench/results/bench_prune_moe.{json,png}.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import arguments, plot, print_table, write_results
from .evaluate import LlamaEval
from .models import tinygguf


def planted_hook(n_expert: int, seed: int):
    """Dead experts (never routed, outputs near zero) and weak ones (routed, outputs / 20) per layer."""
    rng = np.random.default_rng(seed)
    q = n_expert // 4
    roles: dict[int, tuple[list[int], list[int]]] = {}

    def role(il: int):
        if il not in roles:
            perm = [int(x) for x in rng.permutation(n_expert)]
            roles[il] = (sorted(perm[:q]), sorted(perm[q:2 * q]))
        return roles[il]

    def hook(name: str, v: np.ndarray) -> np.ndarray:
        v = v.copy()
        if name == "token_embd.weight":
            v[:, 0] = 1.0   # a constant component the router of dead experts weighs strongly negative
        if not name.startswith("blk."):
            return v
        il, part = int(name.split(".")[1]), name.split(".")[2]
        dead, weak = role(il)
        if part == "ffn_gate_inp":
            v *= 4.0
            v[:, 0] = 0.0
            v[dead, 0] = -4.0
        elif part == "ffn_down_exps":
            v[dead] *= 1e-3
            v[weak] *= 0.05
        elif part == "attn_output":
            v *= 0.1
        return v
    return hook, roles


def heldout_text(max_chars: int) -> tuple[str, str]:
    from ..prune import corpus, wide

    man = wide.man_units(max_chars)
    if sum(len(t) for _, t in man) >= max_chars // 2:
        return "man pages", "\n\n".join(t for _, t in man)
    held = corpus.corpora("heldout")["code"]
    return "held-out stdlib code", "\n\n".join(t for _, t in held.items)


def compare(ref: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """(mean KL(ref || other) in nats, top-1 agreement) over every position."""
    lp = ref - np.logaddexp.reduce(ref, -1, keepdims=True)
    lq = other - np.logaddexp.reduce(other, -1, keepdims=True)
    kl = float((np.exp(lp) * (lp - lq)).sum(-1).mean())
    return kl, float((ref.argmax(-1) == other.argmax(-1)).mean())


def options() -> argparse.ArgumentParser:
    ap = arguments(__doc__)
    ap.add_argument("--experts-keep", type=float, default=0.5)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--used", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--ff", type=int, default=128, help="expert FFN width")
    ap.add_argument("--calib-windows", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--heldout-windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    return ap


def write_models(tmp: Path, args) -> tuple[dict[str, Path], dict]:
    """The random and the planted model; the planted experts' roles by layer."""
    tg = tinygguf("bench_prune_moe")
    hook, roles = planted_hook(args.experts, 7)
    models = {kind: tg.write_tiny_gguf(
        tmp / f"{kind}.gguf", "qwen3moe", n_embd=args.embd, n_layer=args.layers, n_head=4, n_head_kv=2,
        n_ff=args.ff, n_ctx=max(256, args.seq_len), n_expert=args.experts, n_expert_used=args.used, seed=3,
        tensor_hook=h) for kind, h in (("random", None), ("planted", hook))}
    return models, roles


def windows(path: Path, text: str, args) -> list[list[int]]:
    """Held-out windows of --seq-len tokens (BOS first) of `text`."""
    with LlamaEval(path, n_ctx=args.seq_len) as ev:
        toks = ev.tokenize(text)
    wins = [[1] + toks[i:i + args.seq_len - 1] for i in range(0, len(toks), args.seq_len - 1)]
    return [w for w in wins if len(w) == args.seq_len][: args.heldout_windows]


def ranking(path: Path, method: str, seeds: list[int], logits, tmp: Path, args) -> dict:
    """The model at `path` pruned with one expert ranking (averaged over `seeds`), against its source."""
    from ..prune import PruneConfig, prune

    base = logits(path)
    kls, agree, secs, removed = [], [], [], None
    for seed in seeds:
        out = tmp / f"{path.stem}-{method}-{seed}.gguf"
        cfg = PruneConfig(keep=1.0, experts_keep=args.experts_keep, expert_method=method, recover_steps=0,
                          calib_windows=args.calib_windows, seq_len=args.seq_len, seed=seed, threads=args.threads)
        t = time.perf_counter()
        res = prune(path, out, cfg, progress=False, cache_dir=tmp / "cache")
        secs.append(time.perf_counter() - t)
        kl, ag = compare(base, logits(out))
        kls.append(kl)
        agree.append(ag)
        removed = removed or [res.metadata[f"experts.removed.{il}"] for il in range(args.layers)]
        size = out.stat().st_size / path.stat().st_size
        out.unlink()
    return {"kl": float(np.mean(kls)), "top1": float(np.mean(agree)), "size_ratio": size,
            "seconds": float(np.mean(secs)), "seeds": seeds, "removed_layer0": removed[0]}


def report(res: dict, n_windows: int) -> None:
    args, results, source_name = argparse.Namespace(**res["args"]), res["results"], res["heldout"]
    rows = [[*key.split("/"), r["kl"], f"{100 * r['top1']:.1f}%", r["size_ratio"],
             str(r.get("removed_dead_weak_layer0", "-"))] for key, r in results.items()]
    title = (f"expert pruning, experts-keep {args.experts_keep:g} of {args.experts} ({args.used} routed), "
             f"{args.layers} layers; vs the source on {n_windows} x {args.seq_len} tokens of {source_name}")
    print_table(title, ["model", "ranking", "KL nats/token", "top-1 agree", "size x", "layer 0 dead/weak removed"],
                rows)
    q = args.experts // 4
    print(f"(planted: {q} dead and {q} weak experts per layer; keep {args.experts_keep:g} removes "
          f"{args.experts - max(1, round(args.experts_keep * args.experts))})")

    def draw(ax):
        kinds = ["random", "planted"]
        methods = ["reap", "frequency", "random"]
        x = np.arange(len(kinds))
        for i, m in enumerate(methods):
            ax.bar(x + (i - 1) * 0.27, [results[f"{k}/{m}"]["kl"] for k in kinds], 0.27, label=m)
        ax.set_xticks(x, [f"{k} weights" for k in kinds])
        ax.set_ylabel("KL vs source (nats/token)")
        ax.set_title(f"experts-keep {args.experts_keep:g}: tiny random qwen3moe, held-out {source_name}")
        ax.legend(title="ranking")
    plot("bench_prune_moe", draw)


def main(argv=None) -> int:
    args = options().parse_args(argv)
    source_name, text = heldout_text(400_000)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models, roles = write_models(tmp, args)
        wins = windows(models["random"], text, args)

        def logits(path):
            with LlamaEval(path, n_ctx=args.seq_len, n_threads=args.threads) as ev:
                return np.concatenate([ev.logits(w) for w in wins])
        for kind, path in models.items():
            for method, seeds in (("reap", [0]), ("frequency", [0]), ("random", [0, 1, 2])):
                r = ranking(path, method, seeds, logits, tmp, args)
                if kind == "planted":
                    dead, weak = roles[0]
                    r["removed_dead_weak_layer0"] = [sum(e in dead for e in r["removed_layer0"]),
                                                     sum(e in weak for e in r["removed_layer0"])]
                results[f"{kind}/{method}"] = r
    res = {"args": vars(args), "heldout": source_name, "results": results,
           "planted_roles_layer0": {"dead": roles[0][0], "weak": roles[0][1]}}
    write_results("bench_prune_moe", res)
    report(res, len(wins))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
