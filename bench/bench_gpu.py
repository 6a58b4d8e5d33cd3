"""The runtime on a GPU at a real model shape, against llama.cpp's own tools, in one run.

    python -m comfyui_a3b.bench.bench_gpu --out results/ --bin path/to/llama.cpp/build/bin
    python -m comfyui_a3b.bench.bench_gpu --out /tmp/g --shape tiny          # a check on the CPU

Needs a llama-cpp-python built with CUDA (docs/gpu.md says how) and, for the comparison rows,
`llama-batched-bench` and `llama-server` built from the same vendored llama.cpp sources.

1. Writes a random-weight GGUF at Qwen3-8B's shape (36 layers, 4096 wide, FFN 12288, 32 query and
   8 KV heads of 128, vocabulary 151,936), Q4_0: random nibbles with sane scales, tensor by tensor.
   Random weights are fine for memory and speed, not for text.
2. Raw llama-cpp-python `Llama`, fully offloaded: decode tokens/s of one request (greedy) and
   prompt tokens/s.
3. The runtime, fully offloaded, 16 slots, speculation off: 16 requests on fresh slots, then after
   a warm-up that used every slot out of order decode tokens/s of 1 request, aggregate tokens/s of 4
   and 16 concurrent requests (16 also with confidence spans on), prompt tokens/s; speculation at
   its default as a row of its own; with the rows sampled serially and in threads.
4. llama-batched-bench at 1, 4 and 16 sequences (decode speed, no sampling) and llama-server with
   16 slots at 1, 4 and 16 concurrent requests (aggregate tokens/s, sampling included).
5. GPU memory: weights + generation context; + the embedding context; + a second load spec (an
   editor's, n_ctx 4096) over the same weights; each as a ratio to the first.
6. Unload: seconds from `Runtime.unload()` until the GPU memory is free again.

Writes bench_gpu.json into --out and prints a table.
"""
from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


from . import gpu_memory
from .common import arguments, device_label, free_port, in_threads, model_option, report_option, reported
from .models import SHAPES, prompt, random_model


# -- 1. a random model: models.write_model -----------------------------------------------------------
def gpu_layers() -> int:
    """-1 (everything) where a GPU is, 0 on a CPU-only build (the --shape tiny check here)."""
    from comfyui_a3b.runtime.llama.devices import gpus

    return -1 if gpus() else 0


def concurrent(rt, spec, n: int, gen: int, sampling, confidence=None) -> tuple[list, float, float]:
    """`n` concurrent requests of `gen` tokens from prompts of 16 ids, confidence spans off unless
    `confidence` says otherwise: (their results, decode tokens/s, tokens/s over the whole wall time,
    prompts included).

    Decode is counted as llama-batched-bench counts its decode phase, where every sequence decodes
    in every step: the tokens streamed while all `n` requests were decoding, from the last request's
    first token to the first request's last (a request's first token comes with its prompt). The
    threads submit a few milliseconds apart, so the first requests decode alone or beside another
    one's prompt for a step or two; with 32 tokens a request those steps were a tenth of a window
    counted from the first request's first token."""
    from comfyui_a3b.runtime import ConfidenceConfig

    results: list = []
    stamps: list[list[float]] = [[] for _ in range(n)]

    def one(i: int):
        def took(ev, times=stamps[i]):
            if isinstance(ev.token, int) and ev.token >= 0:
                times.append(time.perf_counter())
        stream = rt.submit(prompt_tokens=prompt(16, 5 + i * 11), model=spec, chat=False, max_tokens=gen,
                           sampling=sampling, confidence=confidence or ConfidenceConfig(enabled=False), on_token=took)
        results.append(stream.result())

    wall = in_threads(one, n)
    if len(results) != n:
        raise RuntimeError(f"{n - len(results)} of {n} requests failed")
    start, end = max(t[0] for t in stamps), min(t[-1] for t in stamps)
    inside = sum(1 for t in stamps for x in t if start < x <= end)
    return results, inside / max(end - start, 1e-9), sum(r.n_tokens for r in results) / wall


# -- 2. raw llama-cpp-python ------------------------------------------------------------------------
def raw_llama(path: Path, gen: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_gpu_layers=-1, n_ctx=4096, n_batch=512, verbose=False)
    llm.create_completion(prompt(16), max_tokens=4, temperature=0.0)   # warm-up
    t0 = time.perf_counter()
    out = llm.create_completion(prompt(16, 3), max_tokens=gen, temperature=0.0)
    decode_tps = out["usage"]["completion_tokens"] / (time.perf_counter() - t0)
    long = prompt(400, 7)
    t0 = time.perf_counter()
    out = llm.create_completion(long, max_tokens=1, temperature=0.0)
    prefill_tps = out["usage"]["prompt_tokens"] / (time.perf_counter() - t0)
    del llm
    return {"decode_tps": decode_tps, "prefill_tps": prefill_tps}


# -- 3. the runtime -----------------------------------------------------------------------------------
def warm_up(rt, spec, n_slots: int, sampling) -> None:
    """Use every slot and release them out of order: requests of different lengths at once, twice
    (what a server or a ComfyUI that has run a batch has done before it is measured)."""
    from comfyui_a3b.runtime import ConfidenceConfig

    for rnd in range(2):
        lengths = [2 + ((k * 7 + rnd * 5) % n_slots) * 3 for k in range(n_slots + n_slots // 2)]
        threads = [threading.Thread(target=lambda k=k, n=n, r=rnd: rt.generate(
            prompt_tokens=prompt(16, 900 + k * 13 + r), model=spec, chat=False, max_tokens=n, sampling=sampling,
            confidence=ConfidenceConfig(enabled=False))) for k, n in enumerate(lengths)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def runtime_rows(path: Path, gen: int, label: str) -> dict:
    """Speculation off (the ratio to llama-batched-bench compares like with like): 16 requests on
    fresh slots right after the load, then after a warm-up that used every slot out of order: 1, 4
    and 16 requests, 16 with confidence spans on, 16 with the default speculation (its own row)."""
    from comfyui_a3b.runtime import ConfidenceConfig, Runtime, preset

    rt = Runtime()
    spec = rt.spec(str(path), n_gpu_layers=gpu_layers(), n_ctx=640, n_parallel=16, n_batch=512, speculative="off")
    m = rt.load(spec)
    greedy = preset("greedy")
    off = ConfidenceConfig(enabled=False)
    out = {"label": label, "offload": m.info.offload, "n_gpu_layers": m.info.n_gpu_layers}

    def run(n: int, confidence=off, s=spec) -> float:
        return concurrent(rt, s, n, gen, greedy, confidence)[2]   # over the whole wall time, as before

    out["fresh_aggregate_tps_16"] = run(16)
    warm_up(rt, spec, 16, greedy)
    out["decode_tps"] = run(1)
    out["decode_tps_entropy"] = run(1, ConfidenceConfig(enabled=True))
    for n in (4, 16):
        out[f"aggregate_tps_{n}"] = run(n)
    out["aggregate_tps_16_entropy"] = run(16, ConfidenceConfig(enabled=True))
    out["warm_vs_fresh_16"] = out["aggregate_tps_16"] / out["fresh_aggregate_tps_16"]
    out["entropy_cost_16"] = 1 - out["aggregate_tps_16_entropy"] / out["aggregate_tps_16"]
    out["stats"] = {k: v for k, v in m.stats.items() if k in ("moved", "decode_calls", "decoded_tokens")}
    long = prompt(400, 7)
    t0 = time.perf_counter()
    r = rt.generate(prompt_tokens=long, model=spec, chat=False, max_tokens=1, sampling=greedy, confidence=off)
    out["prefill_tps"] = r.n_prompt_tokens / (time.perf_counter() - t0)
    spec_auto = rt.spec(str(path), n_gpu_layers=gpu_layers(), n_ctx=640, n_parallel=16, n_batch=512)
    rt.load(spec_auto)
    warm_up(rt, spec_auto, 16, greedy)
    out["speculative_auto"] = {n: run(n, s=spec_auto) for n in (1, 16)}
    rt.unload()
    return out


# -- 4. llama.cpp's tools --------------------------------------------------------------------------
def batched_bench(binary: Path, path: Path, gen: int) -> dict:
    cmd = [str(binary), "-m", str(path), "-ngl", "99", "-c", str(16 * (32 + gen) + 64), "-b", "2048", "-ub", "512",
           "-npp", "32", "-ntg", str(gen), "-npl", "1,4,16"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    rows = {}
    for line in (p.stdout + p.stderr).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            rows[int(cells[2])] = {"speed_tg": float(cells[7]), "speed_pp": float(cells[5])}
    pp = subprocess.run([str(binary), "-m", str(path), "-ngl", "99", "-c", "1024", "-b", "2048", "-ub", "512",
                         "-npp", "512", "-ntg", "1", "-npl", "1"], capture_output=True, text=True, timeout=600)
    for line in (pp.stdout + pp.stderr).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            rows["prefill_512"] = float(cells[5])
    return {"command": " ".join(cmd), "rows": rows, "tail": (p.stdout + p.stderr)[-1500:] if not rows else ""}


def llama_server(binary: Path, path: Path, gen: int) -> dict:
    port = free_port()
    proc = subprocess.Popen([str(binary), "-m", str(path), "-ngl", "99", "-np", "16", "-c", str(16 * 640),
                             "--host", "127.0.0.1", "--port", str(port), "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None:
                return {"error": (proc.stderr.read() or "")[-1500:]}
            time.sleep(0.5)

        def one(i: int, out: list):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            body = json.dumps({"prompt": prompt(16, 5 + i * 11), "n_predict": gen, "temperature": 0.0,
                               "cache_prompt": False, "ignore_eos": True})
            c.request("POST", "/completion", body, {"Content-Type": "application/json"})
            out.append(json.loads(c.getresponse().read())["tokens_predicted"])

        rows = {}
        one(0, [])   # warm-up
        for n in (1, 4, 16):
            got: list[int] = []
            threads = [threading.Thread(target=one, args=(i, got)) for i in range(n)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rows[n] = sum(got) / (time.perf_counter() - t0)
        return {"aggregate_tps": rows}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--out", required=True, help="folder for bench_gpu.json (and the model, unless --model)")
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    model_option(ap, help="an existing GGUF instead of writing a random one")
    ap.add_argument("--bin", help="folder with llama-batched-bench and llama-server")
    ap.add_argument("--gen", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--only", default="raw,runtime,tools,memory", help="which parts to run (comma list)")
    report_option(ap)
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if reported(args, lambda res: report(res, out_dir)):
        return 0
    res = measure(args, out_dir)
    report(res, out_dir)
    return 0


def measure(args, out_dir: Path) -> dict:
    """The parts of --only, each written into bench_gpu.json as soon as it is measured."""
    parts = set(args.only.split(","))
    res: dict = {"shape": args.shape, "gen": args.gen, "command": " ".join(sys.argv)}
    res["device"] = device_label()

    path, took = random_model(args.model, out_dir / f"random-{args.shape}.q4_0.gguf", args.shape)
    if took is not None:
        res["write_model_s"] = took
    res["model_bytes"] = path.stat().st_size

    def step(name, fn):
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - a failing part is reported, the others still run
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        res.setdefault("seconds", {})[name] = time.perf_counter() - t0
        (out_dir / "bench_gpu.json").write_text(json.dumps(res, indent=2, default=str))
        print(name, json.dumps(res[name], default=str)[:600], flush=True)

    if "raw" in parts:
        step("raw", lambda: raw_llama(path, args.gen))
    if "runtime" in parts:
        os.environ["A3B_SAMPLE_THREADS"] = "0"
        step("runtime_serial", lambda: _fresh(runtime_rows, path, args.gen, "rows sampled one after another"))
        os.environ["A3B_SAMPLE_THREADS"] = "16"
        step("runtime_threads", lambda: _fresh(runtime_rows, path, args.gen, "rows sampled in threads"))
    if "tools" in parts and args.bin:
        b = Path(args.bin)
        step("batched_bench", lambda: batched_bench(b / "llama-batched-bench", path, args.gen))
        step("llama_server", lambda: llama_server(b / "llama-server", path, args.gen))
    if "memory" in parts:
        step("memory", lambda: gpu_memory.memory_rows(path, gpu_layers, prompt))
    return res


def report(res: dict, out_dir: Path) -> list[list[str]]:
    """The table (printed) and bench_gpu.png: decode tokens/s at 1, 4 and 16 concurrent requests."""
    rows: list[list[str]] = []
    series: dict[str, dict[int, float]] = {}

    def add(label: str, by_n: dict[int, float]):
        series[label] = by_n
        base = (res.get("batched_bench", {}).get("rows") or {})
        cells = []
        for n in (1, 4, 16):
            v = by_n.get(n)
            ref = (base.get(n) or base.get(str(n)) or {}).get("speed_tg")
            ratio = f" ({v / ref:.2f}x)" if v is not None and ref and label != "llama-batched-bench" else ""
            cells.append("-" if v is None else f"{v:.0f}{ratio}")
        rows.append([label, *cells])

    if "error" not in res.get("raw", {"error": 1}):
        add("llama-cpp-python Llama", {1: res["raw"]["decode_tps"]})
    for key, label in (("runtime_serial", "a3b runtime"), ("runtime_threads", "a3b runtime, rows sampled in threads")):
        r = res.get(key, {})
        if "decode_tps" in r:
            add(label + " (after a warm-up)", {1: r["decode_tps"], 4: r["aggregate_tps_4"], 16: r["aggregate_tps_16"]})
            if "fresh_aggregate_tps_16" in r:
                add(label + ", fresh slots", {16: r["fresh_aggregate_tps_16"]})
                add(label + ", confidence spans on", {1: r["decode_tps_entropy"], 16: r["aggregate_tps_16_entropy"]})
            if "speculative_auto" in r:
                add(label + ", speculative=auto", {int(n): v for n, v in r["speculative_auto"].items()})
    bb = (res.get("batched_bench", {}).get("rows") or {})
    if bb:
        add("llama-batched-bench", {int(n): v["speed_tg"] for n, v in bb.items() if str(n).isdigit()})
    ls = res.get("llama_server", {}).get("aggregate_tps")
    if ls:
        add("llama-server", {int(n): v for n, v in ls.items()})
    head = ["decode tokens/s (x llama-batched-bench)", "1 request", "4 concurrent", "16 concurrent"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    prefill = {"Llama": res.get("raw", {}).get("prefill_tps"),
               "a3b runtime": res.get("runtime_threads", {}).get("prefill_tps"),
               "llama-batched-bench": bb.get("prefill_512")}
    print("prefill tokens/s:", ", ".join(f"{k} {v:.0f}" for k, v in prefill.items() if v))
    mem = res.get("memory", {})
    if mem.get("gen_bytes"):   # 0 on a CPU-only build
        print(f"GPU memory: generation {mem['gen_bytes'] / 2**30:.2f} GiB, + embeddings x{mem['ratio_embed']:.2f}, "
              f"+ the language server x{mem['ratio_editor']:.2f} (with its own 4096-token context "
              f"x{mem.get('ratio_editor_own_ctx') or 0:.2f}); unload frees it in {mem['unload_s']:.2f} s; "
              f"auto: {mem['auto_choice']}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return rows
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, by_n in series.items():
        ns = sorted(by_n)
        ax.plot(ns, [by_n[n] for n in ns], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 4, 16], ["1", "4", "16"])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tokens/s (all requests)")
    ax.set_title(f"random {res.get('shape')} Q4_0 on {res.get('device', 'the GPU')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "bench_gpu.png", dpi=120)
    return rows


def _fresh(fn, *args):
    """Run fn in a fresh interpreter (module-level settings such as the sampling threads are read at import)."""
    code = ("import json, sys; from comfyui_a3b.bench import bench_gpu as b; from pathlib import Path; "
            f"print('RESULT', json.dumps(b.{fn.__name__}(Path({str(args[0])!r}), {args[1]!r}, {args[2]!r})))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=os.environ.copy())
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(p.stderr[-1500:])
    return json.loads(line[7:])


if __name__ == "__main__":
    sys.exit(main())
