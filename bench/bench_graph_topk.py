"""Where a sampled row's candidates are found, steady decode steps on one context: the runtime's
CPU pass over every row the GPU copied back (rows.top_candidates, then the chain over them) against a
top-k chain of llama.cpp's alone attached to each sequence (only `--k` logits a row come back, and
the same CPU chain draws from them) and against the whole chain in the graph, with bare decode steps
as the floor. The runtime keeps the first: the others were measured here, and through `a3b serve`
(docs/figures.md, "Candidates found in the graph").

    python3 -m comfyui_a3b.bench.bench_graph_topk MODEL.gguf            # on a GPU; --ngl 0 on a CPU
    python3 -m comfyui_a3b.bench.bench_graph_topk --report bench/results/bench_graph_topk.json

The context is the runtime's (backend.context_params: 16 slots of 512 cells, one KV stream each).
For 1, 4 and 16 sequences: a 33-token prompt each, then `--steps` decode steps of one token per
sequence at temperature 0.7, top-k 40 (chains attached before the prompts, so llama.cpp's rebuild
after an attach is not timed), medians over the steps after the first 8. Writes
bench/results/bench_graph_topk.json (.png with matplotlib).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from .common import arguments, command, execute, model_option, plot, print_table, results_options

VARIANTS = ("decode only", "CPU over every row", "graph top-k + CPU chain", "whole chain in the graph")


def draw_graph_candidates(L, ctx, row: int, chain) -> int:
    """The CPU chain over the candidates a top-k chain found in the graph for output `row` (ids
    ascending, as the runtime's candidates are), accepted into the chain."""
    from comfyui_a3b.runtime.llama.rows import draw_among

    n = L.llama_get_sampled_logits_count_ith(ctx, row)
    ids = np.ctypeslib.as_array(L.llama_get_sampled_candidates_ith(ctx, row), shape=(n,))
    order = np.argsort(ids, kind="stable")
    values = np.ctypeslib.as_array(L.llama_get_sampled_logits_ith(ctx, row), shape=(n,))
    return draw_among(L, chain, ids[order], values[order])


def _chains(L, n: int, variant: str, k: int, graph_k: int) -> list:
    out = []
    for s in range(n):
        c = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if variant == VARIANTS[2]:
            L.llama_sampler_chain_add(c, L.llama_sampler_init_top_k(graph_k))
        else:
            L.llama_sampler_chain_add(c, L.llama_sampler_init_top_k(k))
            L.llama_sampler_chain_add(c, L.llama_sampler_init_top_p(0.95, 1))
            L.llama_sampler_chain_add(c, L.llama_sampler_init_min_p(0.05, 1))
            L.llama_sampler_chain_add(c, L.llama_sampler_init_temp(0.7))
            L.llama_sampler_chain_add(c, L.llama_sampler_init_dist(1234 + s))
        out.append(c)
    return out


def run(L, ctx, batch, w, n: int, variant: str, steps: int, graph_k: int) -> dict:
    from comfyui_a3b.runtime.generation import SamplingParams
    from comfyui_a3b.runtime.llama import chain as chains
    from comfyui_a3b.runtime.llama.binding import fill_batch, sequence
    from comfyui_a3b.runtime.llama.rows import draw, top_candidates

    sp = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)
    L.llama_memory_clear(L.llama_get_memory(ctx), False)
    cpu = [chains.build(sp, 1234 + s, w.n_vocab, w.vocab_ptr, []) for s in range(n)]
    attached = _chains(L, n, variant, sp.top_k, graph_k) if variant in VARIANTS[2:] else []
    for s, c in enumerate(attached):
        if not L.llama_set_sampler(ctx, s, c):
            raise SystemExit(f"llama.cpp refused a backend chain ({variant})")
    for s in range(n):
        fill_batch(batch, sequence([1 + (s * 7 + i) % 1000 for i in range(33)], 0, s))
        L.llama_decode(ctx, batch)
    tok, step_s, sample_s, drawn = [5] * n, [], [], []
    for step in range(steps + 8):
        t0 = time.perf_counter()
        fill_batch(batch, [(tok[s], 33 + step, s, True) for s in range(n)])
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit(f"llama_decode failed ({variant})")
        L.llama_synchronize(ctx)
        t1 = time.perf_counter()
        for s in range(n):
            if variant == VARIANTS[1]:
                row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, s), shape=(w.n_vocab,))
                tok[s] = draw(L, cpu[s], row, top_candidates(row, sp.top_k))
            elif variant == VARIANTS[2]:
                tok[s] = draw_graph_candidates(L, ctx, s, cpu[s])
            elif variant == VARIANTS[3]:
                tok[s] = L.llama_get_sampled_token_ith(ctx, s)
                L.llama_sampler_accept(attached[s], tok[s])
            else:
                tok[s] = 5 + (step * 13 + s) % 1000
        if step >= 8:
            step_s.append(time.perf_counter() - t0)
            sample_s.append(time.perf_counter() - t1)
        drawn.append(list(tok))
    for s in range(len(attached)):
        L.llama_set_sampler(ctx, s, None)
    for c in attached + cpu:
        L.llama_sampler_free(c)
    step = float(np.median(step_s))
    return {"sequences": n, "variant": variant, "step_ms": step * 1e3,
            "sample_ms": float(np.median(sample_s)) * 1e3, "tokens_per_s": n / step, "tokens": drawn}


def measure(path: str, ngl: int, steps: int, rounds: int, graph_k: int, counts=(1, 4, 16)) -> list[dict]:
    """Every variant at each sequence count, `rounds` times; the CPU chain draws the same tokens from
    the graph's candidates as from its own pass over the row (raises where it does not)."""
    from comfyui_a3b.runtime import Runtime
    from comfyui_a3b.runtime.llama.backend import context_params
    from comfyui_a3b.runtime.llama.binding import llama

    rt = Runtime()
    spec = rt.spec(path, n_gpu_layers=ngl, n_ctx=512, n_parallel=16, n_batch=256, speculative="off",
                   backend_sampling="on")
    w = rt.load(spec).weights
    L = llama()
    ctx = L.llama_init_from_model(w.ptr, context_params(spec))
    batch = L.llama_batch_init(1024, 0, 1)
    rows = []
    try:
        for n in counts:
            for _ in range(rounds):   # variants alternate: a drift of the machine hits each alike
                for v in VARIANTS:
                    rows.append(run(L, ctx, batch, w, n, v, steps, graph_k))
                    print(json.dumps({k: x for k, x in rows[-1].items() if k != "tokens"}), flush=True)
                cpu, graph = (rows[-4 + VARIANTS.index(v)].pop("tokens") for v in VARIANTS[1:3])
                if cpu != graph:
                    raise AssertionError(f"{n} sequences: the graph's candidates drew other tokens than the row")
                for r in rows[-4:]:
                    r.pop("tokens", None)
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        rt.unload()
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (sequences, variant): the median over the rounds, and the ratio to the CPU's pass."""
    out = []
    for n in sorted({r["sequences"] for r in rows}):
        base = np.median([r["step_ms"] for r in rows if r["sequences"] == n and r["variant"] == VARIANTS[1]])
        for v in VARIANTS:
            mine = [r for r in rows if r["sequences"] == n and r["variant"] == v]
            if mine:
                step = float(np.median([r["step_ms"] for r in mine]))
                out.append({"sequences": n, "variant": v, "step_ms": step,
                            "sample_ms": float(np.median([r["sample_ms"] for r in mine])),
                            "tokens_per_s": n / step * 1e3, "vs_cpu": float(base) / step})
    return out


def report(res: dict) -> None:
    s = summary(res["rows"])
    print_table("Steady decode steps, temperature 0.7, top-k 40 (medians)",
                ["sequences", "where the candidates come from", "step ms", "sampling ms", "tokens/s", "x CPU"],
                [(r["sequences"], r["variant"], r["step_ms"], r["sample_ms"], r["tokens_per_s"], r["vs_cpu"])
                 for r in s])

    def chart(ax):
        ns = sorted({r["sequences"] for r in s})
        xs = np.arange(len(ns))
        for i, v in enumerate(VARIANTS):
            tps = [next(r["tokens_per_s"] for r in s if r["sequences"] == n and r["variant"] == v) for n in ns]
            ax.bar(xs + (i - 1.5) * 0.2, tps, 0.2, label=v)
        ax.set_xticks(xs, [f"{n} sequences" for n in ns])
        ax.set_ylabel("tokens/s")
        ax.set_title(res.get("model", ""))
        ax.legend(fontsize=8)

    plot(res["name"], chart, size=(8, 4))


def main(argv=None) -> int:
    ap = arguments(__doc__)
    model_option(ap, positional=True, help="the GGUF to measure")
    ap.add_argument("--ngl", type=int, default=-1, help="n_gpu_layers (-1: all; 0 on a CPU-only build)")
    ap.add_argument("--steps", type=int, default=96, help="timed steps per variant")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the variants")
    ap.add_argument("--k", type=int, default=48, help="tokens the graph's top-k chain keeps (the CPU chain's: 40)")
    results_options(ap, "bench_graph_topk")

    def measured(args) -> dict:
        if not args.model:
            ap.error("a model is needed (or --report)")
        return {"name": args.name, "model": Path(args.model).name,
                "command": command("bench_graph_topk", argv).replace("python ", "python3 ", 1),
                "graph_top_k": args.k, "rows": measure(args.model, args.ngl, args.steps, args.rounds, args.k)}
    return execute(ap, argv, measured, report)


if __name__ == "__main__":
    raise SystemExit(main())
