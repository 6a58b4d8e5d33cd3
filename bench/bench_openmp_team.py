"""One request's decode with and without the OpenMP threads a model load leaves on its thread.

    taskset -c 0,1 python -m comfyui_a3b.bench.bench_openmp_team [--model FILE] [--threads 2]

In an OpenMP build of llama.cpp every barrier of a graph is an OpenMP barrier. On a CPU with AMX the
load converts the weights in an OpenMP region of the loading thread, whose idle threads stay; the
worker thread that decodes starts a team of its own, and with more OpenMP threads than cores libgomp
spins only briefly at each barrier before it sleeps. The runtime releases the loading thread's
threads after a load (runtime/llama/threadpool.release_openmp_threads); this measures the decode
with the release (as shipped) and without it, each in a fresh process, alternating, one request of
256 tokens twice per process: tokens/s, milliseconds inside `llama_decode` per step, and the
process's threads after the load. On a CPU without AMX no team is left and the two agree.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from .common import arguments, execute, median, model_option, plot, print_table, results_options

CHILD = textwrap.dedent("""
    import dataclasses, json, os, sys, time
    model, variant, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if variant == "kept":
        from comfyui_a3b.runtime.llama import threadpool
        threadpool.release_openmp_threads = lambda: False
    from comfyui_a3b.runtime import ConfidenceConfig, Runtime, preset
    import comfyui_a3b.runtime.llama.backend as bk
    rt = Runtime()
    m = rt.load(model or None, speculative="off", n_parallel=4, n_threads=threads)
    n_threads = len(os.listdir("/proc/self/task"))
    acc = [0.0, 0]
    real = bk.llama
    class Timed:
        def __getattr__(self, k):
            f = getattr(real(), k)
            if k != "llama_decode":
                return f
            def timed(*a):
                t = time.perf_counter(); r = f(*a); acc[0] += time.perf_counter() - t; acc[1] += 1; return r
            return timed
    timed = Timed()
    bk.llama = lambda: timed
    sp = dataclasses.replace(preset("greedy"), ignore_eos=True)
    runs = []
    for _ in range(2):
        acc[:] = [0.0, 0]
        r = m.submit(rt.request(prompt_tokens=[1] + list(range(300, 332)), chat=False, max_tokens=256, sampling=sp,
                                confidence=ConfidenceConfig(enabled=False))).result()
        runs.append({"tps": r.tokens_per_second, "decode_ms": acc[0] / acc[1] * 1e3})
    print(json.dumps({"threads_after_load": n_threads, "repacked": m.weights.repacked, "runs": runs}))
""")
VARIANTS = {"released": "threads of the load released (as shipped)", "kept": "threads of the load kept"}


def child(model: str, variant: str, threads: int) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, model, variant, str(threads)], capture_output=True, text=True,
                       timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"bench_openmp_team: the {variant} child failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def report(res: dict) -> None:
    rows = []
    for v, label in VARIANTS.items():
        runs = [r for c in res["children"][v] for r in c["runs"]]
        rows.append([label, f"{median([r['tps'] for r in runs]):.0f}", f"{median([r['decode_ms'] for r in runs]):.2f}",
                     res["children"][v][0]["threads_after_load"]])
    print_table(f"one request, {res['threads']} threads ({res['model']})",
                ["variant", "tokens/s", "llama_decode ms/step", "threads after load"], rows)

    def draw(ax):
        ax.bar([r[0].split(" (")[0] for r in rows], [float(r[1]) for r in rows], color=["tab:green", "tab:gray"])
        ax.set_ylabel("decode tokens/s, one request")
        ax.set_title(f"OpenMP threads of the load, {res['threads']} threads")
    plot(res["name"], draw)


def main(argv=None) -> int:
    ap = arguments(__doc__)
    model_option(ap, default="", help="GGUF file (default: the embedded model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=2, help="processes per variant, alternating")
    results_options(ap, "bench_openmp_team")
    return execute(ap, argv, measure, report)


def measure(args) -> dict:
    res = {"model": args.model or "embedded", "threads": args.threads, "command": " ".join(sys.argv),
           "children": {v: [] for v in VARIANTS}}
    for _ in range(args.pairs):
        for v in VARIANTS:
            res["children"][v].append(child(args.model, v, args.threads))
    return res


if __name__ == "__main__":
    sys.exit(main())
