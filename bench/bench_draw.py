"""What drawing one token from a logits row costs on the CPU: llama.cpp's `llama_sampler_sample`
path (every logit copied into an (id, logit, p) record, the chain over all of them) against the
runtime's draw from the row's top candidates (runtime/llama/rows.py), the same chain, in one run.

    python -m comfyui_a3b.bench.bench_draw                   # rows of 152k (Qwen) and 49k (SmolLM2)
    python -m comfyui_a3b.bench.bench_draw --report bench/results/bench_draw.json

A row here is random (Gaussian logits with a few likely tokens), fresh from memory for each draw as
a decode's row is (the rows are cycled through a set larger than the caches); the chain's repeat
penalty has seen 64 tokens. Both paths draw the same token (checked on every draw). Writes
bench/results/bench_draw.json and .png.
"""
from __future__ import annotations

import ctypes
import time

import numpy as np

from .common import arguments, command, execute, plot, print_table, results_options

#: (name, SamplingParams fields): the default chain at temperature 0.7 (penalty after top-k), the
#: chain at temperature 0 with the default penalty (penalty before the likeliest token), llama.vim's
CHAINS = (("t 0.7, top-k 40, penalty 1.1", dict(temperature=0.7, top_k=40, repeat_penalty=1.1)),
          ("t 0, penalty 1.1", dict(temperature=0.0, repeat_penalty=1.1)),
          ("t 0.7, top_k / top_p order", dict(temperature=0.7, top_k=40, samplers=["top_k", "top_p"])))


def rows_of(n_vocab: int, count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((count, n_vocab), dtype=np.float32) * 2
    for r in rows:
        r[rng.integers(0, n_vocab, 8)] += 12
    return rows


def whole_row(L, chain, row: np.ndarray, records: np.ndarray, ids: np.ndarray) -> int:
    """llama_sampler_sample's work: the row into n_vocab records (`ids`: every token id, made once),
    the chain over them, the accept."""
    records["id"] = ids
    records["logit"] = row
    records["p"] = 0.0
    arr = L.llama_token_data_array(records.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), row.shape[0], -1, False)
    L.llama_sampler_apply(chain, ctypes.byref(arr))
    tok = int(records["id"][arr.selected])
    L.llama_sampler_accept(chain, tok)
    return tok


def measure(n_vocab: int, draws: int) -> list[dict]:
    from comfyui_a3b.runtime.generation import SamplingParams
    from comfyui_a3b.runtime.llama import chain as chains
    from comfyui_a3b.runtime.llama.binding import llama
    from comfyui_a3b.runtime.llama.rows import TOKEN_DATA, draw, top_candidates

    L = llama()
    rows = rows_of(n_vocab, max(8, (64 << 20) // (n_vocab * 4)))   # 64 MB of rows: past the caches
    records = np.empty(n_vocab, TOKEN_DATA)
    every = np.arange(n_vocab, dtype=np.int32)
    out = []
    for name, fields in CHAINS:
        sp = SamplingParams(**fields)
        k = chains.candidates(sp)
        a, b = (chains.build(sp, 7, n_vocab, None, []) for _ in range(2))
        for c in (a, b):
            for t in range(0, 64 * 97, 97):
                L.llama_sampler_accept(c, t % n_vocab)
        # one path over all the draws, then the other: a row is out of the caches when each reads it
        t_whole = time.perf_counter()
        whole = [whole_row(L, a, rows[i % len(rows)], records, every) for i in range(draws)]
        t_whole = time.perf_counter() - t_whole
        t_cand = time.perf_counter()
        cand = [draw(L, b, rows[i % len(rows)], top_candidates(rows[i % len(rows)], k)) for i in range(draws)]
        t_cand = time.perf_counter() - t_cand
        if whole != cand:
            i = next(i for i, (x, y) in enumerate(zip(whole, cand)) if x != y)
            raise AssertionError(f"{name}: the whole row drew {whole[i]}, the candidates {cand[i]} (draw {i})")
        for c in (a, b):
            L.llama_sampler_free(c)
        out.append({"vocab": n_vocab, "chain": name, "candidates": k, "whole_row_ms": t_whole / draws * 1e3,
                    "candidates_ms": t_cand / draws * 1e3, "speedup": t_whole / t_cand})
    return out


def report(res: dict) -> None:
    rows = [(r["vocab"], r["chain"], r["candidates"], r["whole_row_ms"], r["candidates_ms"], r["speedup"])
            for r in res["rows"]]
    print_table("One token drawn from a row, ms", ["vocab", "chain", "top", "whole row", "candidates", "x"], rows)

    def draw(ax):
        labels = [f"{r['chain']}\n{r['vocab'] // 1000}k" for r in res["rows"]]
        xs = np.arange(len(labels))
        ax.bar(xs - 0.2, [r["whole_row_ms"] for r in res["rows"]], 0.4, label="whole row (llama_sampler_sample)")
        ax.bar(xs + 0.2, [r["candidates_ms"] for r in res["rows"]], 0.4, label="top candidates")
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_ylabel("ms per token")
        ax.legend(fontsize=8)

    plot(res["name"], draw, size=(8, 4))


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--vocab", default="151936,49152", help="vocabulary sizes (comma list)")
    ap.add_argument("--draws", type=int, default=400, help="draws per chain and size")
    results_options(ap, "bench_draw")
    return execute(ap, argv, lambda args: {
        "name": args.name, "command": command("bench_draw", argv),
        "rows": [r for n in map(int, args.vocab.split(",")) for r in measure(n, args.draws)]}, report)


if __name__ == "__main__":
    raise SystemExit(main())
