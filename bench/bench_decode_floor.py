"""What the runtime adds to llama.cpp's decode: the runtime against bare llama_decode calls on the
same weights and the same context parameters, in one run.

    python3 -m comfyui_a3b.bench.bench_decode_floor MODEL.gguf --gen 128 --out DIR     # on a GPU
    python3 -m comfyui_a3b.bench.bench_decode_floor MODEL.gguf --gen 16 --ngl 0        # a check on the CPU
    python3 -m comfyui_a3b.bench.bench_decode_floor --report DIR/decode_floor.json     # table and plot again

For 1, 4 and 16 concurrent greedy requests (16 slots, speculation off):
- the runtime: decode tokens/s from the first request's first token to the last one's last token
  (as llama-batched-bench counts its decode phase), and over the whole wall time;
- the floor: a second context made with the runtime's own context parameters
  (backend.context_params) over the same loaded weights, one llama_decode per step with one token
  per sequence and logits on, (a) waiting for the step only, (b) also taking each row's argmax in
  numpy as a greedy CPU sampler must.
(a) against llama-batched-bench says what the context's settings cost, (b) against (a) what reading
every row's logits costs, the runtime against (b) the scheduler, streaming and Python around it.

Writes decode_floor.json, .md and .png into --out.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .common import arguments, earlier, model_option, report_option

CONCURRENCY = (1, 4, 16)


def runtime_run(rt, spec, n: int, gen: int) -> dict:
    from comfyui_a3b.runtime import preset

    from .bench_gpu import concurrent

    _, decode_tps, wall_tps = concurrent(rt, spec, n, gen, preset("greedy"))
    return {"decode_tps": decode_tps, "wall_tps": wall_tps}


def floor_run(weights, spec, n: int, gen: int) -> dict:
    """Bare llama_decode steps of `n` sequences, one token each, on a context like the runtime's."""
    import numpy as np

    from comfyui_a3b.runtime.llama.backend import context_params
    from comfyui_a3b.runtime.llama.binding import fill_batch, llama, sequence

    from .models import prompt

    L = llama()
    ctx = L.llama_init_from_model(weights.ptr, context_params(spec))
    batch = L.llama_batch_init(512, 0, 1)
    nv = weights.n_vocab

    out = {}
    try:
        for s in range(n):
            p = prompt(16, 5 + s * 11)
            fill_batch(batch, sequence(p, 0, s))
            L.llama_decode(ctx, batch)
        for argmax in (False, True):
            tok = [1] * n
            t0 = time.perf_counter()
            for step in range(gen):
                fill_batch(batch, [(tok[s], 16 + step + (gen if argmax else 0), s, True) for s in range(n)])
                L.llama_decode(ctx, batch)
                if argmax:
                    tok = [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, s), shape=(nv,)).argmax())
                           for s in range(n)]
                else:
                    L.llama_synchronize(ctx)
            out["argmax" if argmax else "decode_only"] = n * gen / (time.perf_counter() - t0)
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    return out


def measure(path: str, gen: int, ngl: int) -> dict:
    from comfyui_a3b.runtime import Runtime

    res: dict = {"model": Path(path).name, "gen": gen, "n_gpu_layers": ngl}
    for n in CONCURRENCY:
        rt = Runtime()
        spec = rt.spec(path, n_gpu_layers=ngl, n_ctx=640, n_parallel=16, n_batch=512, speculative="off",
                       backend_sampling="off")
        m = rt.load(spec)
        runtime_run(rt, spec, 1, 4)   # warm up
        res[f"runtime_{n}"] = runtime_run(rt, spec, n, gen)
        fl = floor_run(m.weights, spec, n, gen)
        res[f"floor_{n}_noargmax"], res[f"floor_{n}_argmax"] = fl["decode_only"], fl["argmax"]
        print(n, res[f"runtime_{n}"], fl, flush=True)
        rt.unload()
    return res


def table(res: dict) -> str:
    lines = ["| requests | runtime decode | runtime wall | floor: decode only | floor: + argmax per row | "
             "runtime / floor+argmax |", "|---|---|---|---|---|---|"]
    for n in CONCURRENCY:
        r = res.get(f"runtime_{n}")
        if not r:
            continue
        a, b = res[f"floor_{n}_noargmax"], res[f"floor_{n}_argmax"]
        lines.append(f"| {n} | {r['decode_tps']:.0f} | {r['wall_tps']:.0f} | {a:.0f} | {b:.0f} | "
                     f"{r['decode_tps'] / b:.2f} |")
    return "\n".join(lines)


def draw(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ns = [n for n in CONCURRENCY if f"runtime_{n}" in res]
    for label, ys in (("runtime (first to last token)", [res[f"runtime_{n}"]["decode_tps"] for n in ns]),
                      ("llama_decode only", [res[f"floor_{n}_noargmax"] for n in ns]),
                      ("llama_decode + argmax per row", [res[f"floor_{n}_argmax"] for n in ns])):
        ax.plot(ns, ys, marker="o", label=label)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{res.get('model', '')}: the runtime against bare decode steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(res: dict, out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text(table(res) + "\n")
    draw(res, out / f"{stem}.png")
    print(table(res))


def main(argv=None) -> int:
    ap = arguments(__doc__)
    model_option(ap, positional=True, help="the GGUF to measure")
    ap.add_argument("--gen", type=int, default=128, help="tokens per request")
    ap.add_argument("--ngl", type=int, default=-1, help="n_gpu_layers (-1: all; 0 on a CPU-only build)")
    ap.add_argument("--out", default=".", help="folder for decode_floor.json/.md/.png")
    report_option(ap)
    args = ap.parse_args(argv)
    res = earlier(args)
    if res is not None:   # written again beside the earlier file
        p = Path(args.report)
        write(res, p.parent, p.stem)
        return 0
    if not args.model:
        ap.error("a model is needed (or --report)")
    res = measure(args.model, args.gen, args.ngl)
    res["command"] = " ".join(["python3 -m comfyui_a3b.bench.bench_decode_floor", *sys.argv[1:]])
    write(res, Path(args.out), "decode_floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
