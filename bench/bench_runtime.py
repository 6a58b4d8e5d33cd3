"""Runtime benchmark: decode speed vs raw llama-cpp-python, load times, memory, concurrency.

    python -m bench.bench_runtime            # about 3 minutes on 2 cores

Every figure is compared with a baseline measured in the same run:
- decode tokens/s through the runtime vs llama-cpp-python's own `Llama` on the same file (ratio);
- cold load (a fresh process) vs cache-hit load (the store's lookup);
- peak RSS of a process serving generation plus embeddings vs one serving generation only (ratio);
- aggregate tokens/s and per-request latency with 1, 2, 4 concurrent requests (vs 1).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

from .common import arguments, median, plot, print_table, write_results

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def _raw_llama(path: str):
    from llama_cpp import Llama

    from comfyui_a3b.runtime.models import vet
    from comfyui_a3b.runtime.llama.backend import thread_counts

    if not vet.repack_allowed():  # Llama() cannot turn llama.cpp's CPU repacking off
        raise SystemExit("bench_runtime: the installed llama-cpp-python crashes in its CPU weight repacking on this "
                         f"processor, so its own Llama() baseline cannot run here; rebuild it: {vet.REBUILD_HINT}")

    dec, batch = thread_counts()  # the same threads as the runtime uses, so the ratio compares code paths
    return Llama(model_path=path, n_ctx=2048, verbose=False, n_batch=256, n_threads=dec, n_threads_batch=batch)


def decode_raw(llm, n_tokens: int) -> float:
    t_first = t_last = None
    count = 0
    msgs = [{"role": "user", "content": PROMPT}]
    for chunk in llm.create_chat_completion(msgs, max_tokens=n_tokens, temperature=0.0, stream=True):
        if chunk["choices"][0]["delta"].get("content"):
            count += 1
            t_last = time.perf_counter()
            t_first = t_first or t_last
    return (count - 1) / (t_last - t_first)


def decode_runtime(rt, n_tokens: int, confidence: bool) -> float:
    from comfyui_a3b.runtime import ConfidenceConfig, preset

    res = rt.generate(PROMPT, max_tokens=n_tokens, sampling=preset("greedy"),
                      confidence=ConfidenceConfig(enabled=confidence))
    return res.tokens_per_second


def decode_rounds(rt, path: str, n_tokens: int, rounds: int) -> dict:
    """Alternate raw / runtime / runtime+entropy in each round; ratios are taken within a round."""
    llm = _raw_llama(path)
    rows = []
    for _ in range(rounds):
        raw = decode_raw(llm, n_tokens)
        ours = decode_runtime(rt, n_tokens, confidence=False)
        ours_e = decode_runtime(rt, n_tokens, confidence=True)
        rows.append((raw, ours, ours_e))
    llm.close()
    return {"raw_llama_cpp_tps": median([r[0] for r in rows]), "runtime_tps": median([r[1] for r in rows]),
            "runtime_entropy_tps": median([r[2] for r in rows]),
            "ratio": median([r[1] / r[0] for r in rows]), "ratio_with_entropy": median([r[2] / r[0] for r in rows]),
            "rounds": rows}


def _subprocess(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def cold_load() -> dict:
    return _subprocess("""
        import json, time
        t0 = time.perf_counter()
        from comfyui_a3b.runtime import get_runtime
        t1 = time.perf_counter()
        rt = get_runtime(); rt.load()
        t2 = time.perf_counter()
        hits = []
        for _ in range(1000):
            a = time.perf_counter(); rt.load(); hits.append(time.perf_counter() - a)
        hits.sort()
        print(json.dumps({"import_s": t1 - t0, "cold_load_s": t2 - t1,
                          "hit_median_s": hits[500], "hit_p99_s": hits[990]}))
    """)


def peak_rss(with_embeddings: bool) -> dict:
    return _subprocess(f"""
        import json
        from comfyui_a3b.runtime import get_runtime, preset
        rt = get_runtime()
        rt.generate({PROMPT!r}, max_tokens=64, sampling=preset("greedy"))
        if {with_embeddings}:
            rt.embed(["document %d about a topic of its own, a few words long" % i for i in range(64)])
        rt.generate({PROMPT!r}, max_tokens=64, sampling=preset("greedy"))
        # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over from the parent across
        # fork + exec, so a child of a big benchmark process would report the parent's peak.
        hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
        print(json.dumps({{"peak_rss_kb": hwm, "weight_loads": rt.store.weight_loads}}))
    """)


def concurrency(rt, n_tokens: int) -> list[dict]:
    from comfyui_a3b.runtime import preset

    spec = rt.spec(None, n_parallel=4)
    rt.generate("warm up", model=spec, max_tokens=4)
    rows = []
    for n in (1, 2, 4):
        lat: list[float] = []
        toks: list[int] = []

        def one(i: int, lat=lat, toks=toks) -> None:
            r = rt.generate(f"{PROMPT} Variation {i}.", model=spec, max_tokens=n_tokens,
                            sampling=preset("default", seed=i))
            lat.append(r.total_time)
            toks.append(r.n_tokens)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        rows.append({"concurrent": n, "aggregate_tps": sum(toks) / wall, "mean_latency_s": sum(lat) / n,
                     "max_latency_s": max(lat), "tokens": sum(toks)})
    base = rows[0]["aggregate_tps"]
    for r in rows:
        r["throughput_ratio"] = r["aggregate_tps"] / base
    return rows


def prompt_beside_generation(rt, rounds: int = 3) -> dict:
    """Time to first token of a ~300-token prompt alone vs while another request generates.

    With n_parallel > 1 every sequence has its own KV cells; a batch mixing one request's prompt
    chunk with another's decode token is split by llama.cpp per sequence, so the scheduler keeps
    prompt chunks in batches of their own. This measures what that buys.
    """
    from comfyui_a3b.runtime import preset
    from comfyui_a3b.runtime.errors import Cancelled

    spec = rt.spec(None, n_parallel=2)
    body = "\n".join(f"def helper_{i}(x):\n    return x * {i} + {i * 7} - len(str(x))" for i in range(20))
    rt.generate("warm up", model=spec, max_tokens=4)
    alone, beside = [], []
    for r in range(rounds):
        prompt = f"# module variant {r}\n{body}\n\ndef main():\n"  # a new first line defeats the prefix cache
        res = rt.generate(prompt, model=spec, chat=False, max_tokens=1, sampling=preset("greedy"))
        alone.append(res.time_to_first_token)
        n_prompt = res.n_prompt_tokens
        bg = rt.submit(PROMPT, model=spec, max_tokens=400, sampling=preset("default", seed=r))
        time.sleep(0.3)  # let it start generating
        res = rt.generate(f"# other variant {r}\n{body}\n\ndef main():\n", model=spec, chat=False, max_tokens=1,
                          sampling=preset("greedy"))
        beside.append(res.time_to_first_token)
        bg.cancel()
        try:
            bg.result()
        except Cancelled:
            pass
    return {"prompt_tokens": n_prompt, "alone_ttft_s": median(alone), "beside_ttft_s": median(beside),
            "ratio": median(beside) / median(alone)}


def decode_section(rt, path: str, args) -> dict:
    decode = decode_rounds(rt, path, args.tokens, args.rounds)
    print_table(f"Decode speed (SmolLM2-135M Q4_1, greedy, {args.tokens} tokens, "
                f"median of {args.rounds} alternating rounds)",
                ["path", "tokens/s", "ratio vs raw (median of rounds)"],
                [["raw llama-cpp-python Llama", decode["raw_llama_cpp_tps"], 1.0],
                 ["runtime (entropy off)", decode["runtime_tps"], decode["ratio"]],
                 ["runtime (entropy monitoring on)", decode["runtime_entropy_tps"], decode["ratio_with_entropy"]]])
    return decode


def load_section() -> dict:
    loads = [cold_load() for _ in range(3)]
    load = {k: median([x[k] for x in loads]) for k in loads[0]}
    print_table("Load time", ["what", "seconds"],
                [["import package", load["import_s"]], ["cold load (new process)", load["cold_load_s"]],
                 ["cache hit (median)", load["hit_median_s"]], ["cache hit (p99)", load["hit_p99_s"]]])
    return load


def memory_section() -> dict:
    gen_only = peak_rss(False)
    gen_embed = peak_rss(True)
    mem = {"gen_only_peak_rss_mb": gen_only["peak_rss_kb"] / 1024,
           "gen_embed_peak_rss_mb": gen_embed["peak_rss_kb"] / 1024,
           "weight_loads_gen_embed": gen_embed["weight_loads"]}
    mem["ratio"] = mem["gen_embed_peak_rss_mb"] / mem["gen_only_peak_rss_mb"]
    print_table("Peak RSS", ["process", "MB", "ratio"],
                [["generation only", mem["gen_only_peak_rss_mb"], 1.0],
                 ["generation + embeddings", mem["gen_embed_peak_rss_mb"], mem["ratio"]]])
    return mem


def scheduler_sections(rt) -> tuple[list[dict], dict]:
    conc = concurrency(rt, 64)
    print_table("Concurrent generation through the scheduler (64 tokens each)",
                ["requests", "aggregate tok/s", "x vs 1", "mean latency s", "max latency s"],
                [[r["concurrent"], r["aggregate_tps"], r["throughput_ratio"], r["mean_latency_s"], r["max_latency_s"]]
                 for r in conc])
    mixed = prompt_beside_generation(rt)
    print_table("Prompt beside a running generation (time to first token, median of 3)",
                ["prompt tokens", "alone s", "beside a generation s", "ratio"],
                [[mixed["prompt_tokens"], mixed["alone_ttft_s"], mixed["beside_ttft_s"], mixed["ratio"]]])
    return conc, mixed


def draw(decode: dict, conc: list[dict]) -> None:
    def on(ax):
        import numpy as np

        fig = ax.figure
        fig.clear()
        a1, a2 = fig.subplots(1, 2)
        a1.bar(["raw Llama", "runtime", "runtime+entropy"],
               [decode["raw_llama_cpp_tps"], decode["runtime_tps"], decode["runtime_entropy_tps"]],
               color=["#888", "#2a7", "#27a"])
        a1.set_ylabel("decode tokens/s")
        a1.set_title("decode speed")
        xs = np.array([r["concurrent"] for r in conc])
        a2.plot(xs, [r["aggregate_tps"] for r in conc], "o-", label="aggregate tok/s")
        a2.set_xlabel("concurrent requests")
        a2.set_xticks(xs)
        a2.set_ylabel("tokens/s")
        a2b = a2.twinx()
        a2b.plot(xs, [r["mean_latency_s"] for r in conc], "s--", color="#c52", label="mean latency")
        a2b.set_ylabel("mean latency (s)")
        a2.set_title("scheduler batching")

    plot("runtime", on, size=(10, 4))


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    from comfyui_a3b.runtime import default_model_path, get_runtime

    rt = get_runtime()
    rt.load()
    decode = decode_section(rt, str(default_model_path()), args)
    load = load_section()
    mem = memory_section()
    conc, mixed = scheduler_sections(rt)
    write_results("runtime", {"decode": decode, "load": load, "memory": mem, "concurrency": conc,
                              "prompt_beside_generation": mixed})
    draw(decode, conc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
