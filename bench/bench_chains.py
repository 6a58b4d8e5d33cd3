"""Requests with confidence spans against the same requests without, through `a3b serve`, one client.

    python -m comfyui_a3b.bench.bench_chains                                    # CPU, the embedded model
    python -m comfyui_a3b.bench.bench_chains --gpu --model m.gguf --token-prompts --name chains_gpu

A request with spans gets a backend chain under `backend_sampling=auto` (its entropy measured in
llama.cpp's graph), and attaching a chain to a sequence makes llama.cpp rebuild its scheduler before
the next decode (runtime/llama/attached.py); a request without spans draws on the CPU. The requests
are the language server's (temperature 0.25, top-p 0.9, top-k 40, min-p 0.05, seed 0, 32 tokens),
sent one after another by one client after a warm-up that used every slot, in blocks of `--requests`:
prompts that share little (each takes the least recently used free slot) and prompts that share a
long start and differ at the end (an editor asking about one file: they keep their slot). Blocks
alternate without and with spans, `--reps` times each. Reported per block kind: time to first token
p50 / p95 as the client sees it, the engine's own (submit to first token, mean), tokens/s, and the
ratio of the time to first token with spans to without, measured in the same run.

Writes bench/results/<name>.json and <name>.png (and prints a table).
"""
from __future__ import annotations

import argparse
import sys

from .bench_serving import Proc, a3b_cmd, a3b_stats, body_of, cell, server_arguments, steps, warm_up
from .common import arguments, free_port, median, model_path, name_option, plot, print_table, write_results

LSP = {"temperature": 0.25, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 0, "repeat_penalty": 1.0}
SHARED_TEXT = "".join(f"def handler_{i}(request):\n    return respond(request, code={i})\n\n" for i in range(24))


def prompt(kind: str, i: int, token_prompts: bool):
    if token_prompts:   # a random model: token ids
        if kind == "shared":
            return [1] + [(k * 7919) % 1500 + 300 for k in range(300)] + [(i * 131 + k) % 1500 + 300 for k in range(8)]
        return [1] + [(k * 7919 + i * 131) % 1500 + 300 for k in range(32)]
    words = ("Apples", "Rivers", "Seven", "Quietly", "Mountains", "Yesterday", "Copper", "Lanterns")
    if kind == "shared":
        return SHARED_TEXT + f"def handler_extra_{i}(request):\n    "
    return f"{words[i % len(words)]} {i}: a short note on why this matters,"


def measure(base: str, kind: str, spans: bool, args) -> dict:
    def body(i: int) -> dict:
        b = body_of("greedy", args.gen, args.token_prompts, False)(i)
        b.update(LSP, prompt=prompt(kind, i, args.token_prompts), confidence=spans)
        return b

    before = a3b_stats(base)
    c = cell(base, 1, args.requests, body)
    st = steps(before, a3b_stats(base))
    return {"ttft_p50_ms": c["ttft_p50_ms"], "ttft_p95_ms": c["ttft_p95_ms"], "engine_ttft_ms": st["engine_ttft_ms"],
            "tps": c["aggregate_tps"], "errors": c["errors"]}


def main(argv=None) -> int:
    ap = arguments(__doc__)
    server_arguments(ap, gen=32)
    ap.add_argument("--requests", type=int, default=12, help="requests per block")
    ap.add_argument("--reps", type=int, default=2, help="blocks of each kind")
    name_option(ap, "chains")
    args = ap.parse_args(argv)
    args.model = str(model_path(args.model))
    args.threads, args.cpus = 0, None
    port = free_port()
    proc = Proc(a3b_cmd(args, port), f"http://127.0.0.1:{port}")
    blocks: dict[str, list[dict]] = {}
    try:
        warm_up(proc.base, args.parallel, args.gen, args.token_prompts, False)
        for kind in ("apart", "shared"):
            once = argparse.Namespace(**{**vars(args), "requests": 1})
            measure(proc.base, kind, False, once)   # the shared start read once before the blocks
            for _ in range(args.reps):
                for spans in (False, True):
                    b = measure(proc.base, kind, spans, args)
                    blocks.setdefault(f"{kind}/{'spans' if spans else 'none'}", []).append(b)
                    print(kind, "spans" if spans else "none", {k: round(v, 1) for k, v in b.items() if k != "errors"},
                          b["errors"] or "", flush=True)
    finally:
        proc.stop()
    summary = {k: {m: median([b[m] for b in bs]) for m in ("ttft_p50_ms", "ttft_p95_ms", "engine_ttft_ms", "tps")}
               for k, bs in blocks.items()}
    ratios = {kind: summary[f"{kind}/spans"]["ttft_p50_ms"] / summary[f"{kind}/none"]["ttft_p50_ms"]
              for kind in ("apart", "shared")}
    print_table(f"requests with and without confidence spans, one client ({args.model.rsplit('/', 1)[-1]})",
                ["prompts/spans", "TTFT p50 ms", "p95", "engine TTFT ms", "tokens/s"],
                [[k, s["ttft_p50_ms"], s["ttft_p95_ms"], s["engine_ttft_ms"], s["tps"]] for k, s in summary.items()])
    print("TTFT p50 with spans / without:", {k: round(v, 2) for k, v in ratios.items()})
    write_results(args.name, {"args": vars(args), "command": "python -m comfyui_a3b.bench.bench_chains " +
                              " ".join(argv if argv is not None else sys.argv[1:]), "blocks": blocks,
                              "summary": summary, "ratios": ratios})

    def draw(ax):
        keys = list(summary)
        ax.bar(range(len(keys)), [summary[k]["ttft_p50_ms"] for k in keys])
        ax.set_xticks(range(len(keys)), keys, fontsize=8)
        ax.set_ylabel("time to first token, p50 (ms)")
        ax.set_title("one client: requests with confidence spans (a backend chain) and without", fontsize=9)
    plot(args.name, draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
