"""`a3b serve` against llama-server on the same model file, in one run: what a user picks between.

    python -m comfyui_a3b.bench.bench_serving                                   # CPU, the embedded model
    python -m comfyui_a3b.bench.bench_serving --model m.gguf --token-prompts --llama-server BIN \\
        --clients 1,4,16 --parallel 16 --n-ctx 512 --gpu --name serving_gpu   # GPU, a random model

Each server runs alone (started, measured, stopped), with its defaults as shipped except what makes
the two the same job: the same slots and context per slot, the model wholly on the GPU with --gpu,
and on the CPU the same threads (`--threads`: both servers' default is otherwise their own). After a
warm-up that has used every slot out of order (a server that has served), each cell is N streaming
clients, each sending `--rounds` requests one after another (33-token prompts, `--gen` tokens each,
`ignore_eos`), greedy and at temperature 0.7 with the same sampler chain on both (top-k 40, top-p
0.95, min-p 0.05, temperature; llama-server is sent that order in `samplers`, which is a3b's own
order). Reported per cell: aggregate tokens/s (all tokens over the cell's wall time), time to first
token p50/p95, the server process's CPU-seconds per 1000 tokens (and, for a3b serve, its event
loop's), and the ratio a3b serve / llama-server. With --passes, a3b serve runs once more with
A3B_COUNT_PASSES=on at the largest client count to report llama.cpp's passes per decode step (the
counting itself slows it, so those timings are not reported).

Writes bench/results/<name>.json and <name>.png (and prints a table).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .common import (arguments, free_port, in_threads, llama_server_binary, llama_server_command, model_option,
                     model_path, percentile, plot, print_table, results_options, write_results)

TEXT_PROMPT = ("Request {i}: write a long, detailed report about the history of lighthouses on the northern "
               "coast, chapter by chapter, with dates.")
SAMPLED = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
MODES = {"greedy": {"temperature": 0.0}, "t0.7": SAMPLED}


def prompt_of(i: int, token_prompts: bool):
    if token_prompts:   # a random model: token ids (its "text" would tokenize to bytes)
        return [1] + [(k * 7919 + i * 131) % 1500 + 300 for k in range(32)]
    return TEXT_PROMPT.format(i=i)


class Proc:
    def __init__(self, cmd: list[str], base: str, env: dict | None = None, log: Path | None = None):
        self.base = base
        self._log = open(log, "wb") if log else subprocess.DEVNULL
        self.p = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {self.p.returncode} (log: {log})")
            try:
                if httpx.get(base + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"{base} did not start")

    def cpu(self) -> tuple[float, float]:
        """(the process's CPU-seconds, its main thread's: the event loop of a3b serve)."""
        import psutil

        p = psutil.Process(self.p.pid)
        t = p.cpu_times()
        main = next((th for th in p.threads() if th.id == self.p.pid), None)
        return t.user + t.system, (main.user_time + main.system_time) if main else 0.0

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(30)
        if self._log is not subprocess.DEVNULL:
            self._log.close()


def one(client: httpx.Client, base: str, body: dict) -> tuple[float, int, float]:
    """A streamed completion: (seconds to the first token, tokens, seconds in all)."""
    t0 = time.perf_counter()
    first, n, usage = None, 0, None
    with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"].get("completion_tokens")
            ch = (ev.get("choices") or [{}])[0]
            if ch.get("text"):
                first = first or time.perf_counter()
                n += 1
    end = time.perf_counter()
    return (first or end) - t0, usage or n, end - t0


def cell(base: str, n_clients: int, rounds: int, bodies) -> dict:
    """`n_clients` clients, each sending `rounds` requests one after another; bodies(i) gives request i."""
    clients = [httpx.Client(timeout=600, trust_env=False) for _ in range(n_clients)]
    out: list[tuple[float, int, float]] = []
    errors: list[str] = []

    def run(k: int):
        for r in range(rounds):
            try:
                out.append(one(clients[k], base, bodies(k * 1000 + r)))
            except Exception as e:  # noqa: BLE001 - reported with the cell
                errors.append(f"{type(e).__name__}: {e}")

    wall = in_threads(run, n_clients)
    for c in clients:
        c.close()
    ttft = [o[0] for o in out]
    tokens = sum(o[1] for o in out)
    return {"clients": n_clients, "requests": len(out), "tokens": tokens, "wall_s": wall,
            "aggregate_tps": tokens / wall, "ttft_p50_ms": percentile(ttft, 0.5) * 1000,
            "ttft_p95_ms": percentile(ttft, 0.95) * 1000, "errors": errors[:3]}


def body_of(mode: str, gen: int, token_prompts: bool, llama_server: bool):
    def make(i: int) -> dict:
        b = {"prompt": prompt_of(i, token_prompts), "max_tokens": gen, "stream": True, "ignore_eos": True,
             "stream_options": {"include_usage": True}, "seed": i, "repeat_penalty": 1.0, **MODES[mode]}
        if llama_server and mode != "greedy":
            b["samplers"] = ["top_k", "top_p", "min_p", "temperature"]   # a3b serve's own order
        return b
    return make


def warm_up(base: str, parallel: int, gen: int, token_prompts: bool, llama_server: bool) -> None:
    """Every slot used, and released out of order: requests of different lengths at once, twice."""
    make = body_of("greedy", gen, token_prompts, llama_server)
    for rnd in range(2):
        lengths = [4 + ((k * 7 + rnd * 3) % parallel) * 3 for k in range(parallel + parallel // 2)]
        cell(base, len(lengths), 1, lambda i, L=lengths, r=rnd: {**make(90000 + r * 1000 + i),
                                                                   "max_tokens": L[i // 1000]})


def measure(name: str, proc: Proc, args, llama_server: bool) -> dict:
    res: dict = {"cells": {}}
    warm_up(proc.base, args.parallel, args.gen, args.token_prompts, llama_server)
    for mode in args.modes.split(","):
        for n in map(int, args.clients.split(",")):
            cpu0, loop0 = proc.cpu()
            stats0 = None if llama_server else a3b_stats(proc.base)
            c = cell(proc.base, n, args.rounds, body_of(mode, args.gen, args.token_prompts, llama_server))
            cpu1, loop1 = proc.cpu()
            if stats0 is not None:
                c["steps"] = steps(stats0, a3b_stats(proc.base))
            c["cpu_s_per_1k_tokens"] = (cpu1 - cpu0) / max(c["tokens"], 1) * 1000
            if not llama_server:
                c["loop_cpu_share"] = (loop1 - loop0) / c["wall_s"]
            res["cells"][f"{mode}/{n}"] = c
            print(f"{name} {mode} {n} clients: {c['aggregate_tps']:.0f} tok/s, TTFT p50 {c['ttft_p50_ms']:.0f} ms, "
                  f"p95 {c['ttft_p95_ms']:.0f} ms, {c['cpu_s_per_1k_tokens']:.2f} CPU-s/1k tokens"
                  + (f", errors {c['errors']}" if c["errors"] else "")
                  + (STEPS.format(**c["steps"]) if "steps" in c else ""), flush=True)
    return res


STEPS = (" | steps {decode_calls}: {step_ms:.2f} ms (launch {ms_per_step:.2f}, engine {wait_ms:.2f}, "
         "sample {sample_ms:.2f}, stream {stream_ms:.2f}, plan {plan_ms:.2f}), {rows_per_step:.1f} rows, "
         "{tokens_per_step:.1f} tokens, "
         "drafted {drafted_tokens} accepted {accepted_tokens}, engine TTFT {engine_ttft_ms:.0f} ms")


def a3b_stats(base: str) -> dict:
    return httpx.get(base + "/props", timeout=600, trust_env=False).json()["a3b_stats"]


def delta(before: dict, after: dict, keys) -> dict:
    """How much each of `keys` of the server's stats grew between two reads."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def steps(before: dict, after: dict) -> dict:
    """What the engine did in a cell: decode calls, their mean time and rows, drafted and accepted tokens."""
    d = delta(before, after, ("decode_calls", "decode_us", "decode_rows", "decoded_tokens", "generated_tokens",
                              "drafted_tokens", "accepted_tokens", "first_token_us", "first_tokens",
                              "step_us", "wait_us", "sample_us", "verify_us"))
    calls = max(d["decode_calls"], 1)
    # where a step's time goes, on the worker thread: llama_decode's launch (ms_per_step), waiting for
    # the engine to finish it (the GPU; on a CPU the launch is the work), sampling the rows, turning
    # tokens into text and streams, and the rest (admission, planning, the KV trims)
    d["ms_per_step"] = d["decode_us"] / calls / 1000
    d["step_ms"] = d["step_us"] / calls / 1000
    d["wait_ms"] = d["wait_us"] / calls / 1000
    d["sample_ms"] = d["sample_us"] / calls / 1000
    d["stream_ms"] = (d["verify_us"] - d["sample_us"]) / calls / 1000
    d["plan_ms"] = (d["step_us"] - d["decode_us"] - d["wait_us"] - d["verify_us"]) / calls / 1000
    d["rows_per_step"] = d["decode_rows"] / calls
    d["tokens_per_step"] = d["decoded_tokens"] / calls
    d["engine_ttft_ms"] = d["first_token_us"] / max(d["first_tokens"], 1) / 1000   # submitted to first token, mean
    return d


def pinned(args, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", args.cpus, *cmd] if args.cpus else cmd


def a3b_cmd(args, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "comfyui_a3b.cli", "serve", "--http", f"127.0.0.1:{port}", "--model", args.model,
           "--parallel", str(args.parallel), "--n-ctx", str(args.n_ctx), "--quiet"]
    cmd += args.a3b_args.split()
    if args.gpu:
        cmd += ["--n-gpu-layers", "-1"]
    elif args.threads:
        cmd += ["--threads", str(args.threads)]
    return pinned(args, cmd)


def llama_server_cmd(args, port: int) -> list[str]:
    binary = args.llama_server or str(llama_server_binary())
    cmd = [*llama_server_command(binary), "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
           "-np", str(args.parallel), "-c", str(args.parallel * args.n_ctx), "-cb", "--no-webui"]
    if args.gpu:
        cmd += ["-ngl", "99"]
    else:
        t = args.llama_server_threads or args.threads
        cmd += ["-ngl", "0"] + (["-t", str(t)] if t else [])
    return pinned(args, cmd)


def passes(args) -> dict:
    """a3b serve with llama.cpp's passes counted, at the largest client count, greedy."""
    port = free_port()
    proc = Proc(a3b_cmd(args, port), f"http://127.0.0.1:{port}", {"A3B_COUNT_PASSES": "on"})
    try:
        n = max(map(int, args.clients.split(",")))
        warm_up(proc.base, args.parallel, args.gen, args.token_prompts, False)
        before = a3b_stats(proc.base)
        cell(proc.base, n, 1, body_of("greedy", args.gen, args.token_prompts, False))
        after = a3b_stats(proc.base)
    finally:
        proc.stop()
    d = delta(before, after, ("passes", "counted_steps", "decode_steps", "decode_step_passes", "moved"))
    d["clients"] = n
    d["passes_per_decode_step"] = d["decode_step_passes"] / max(d["decode_steps"], 1)
    d["passes_per_step"] = d["passes"] / max(d["counted_steps"], 1)
    return d


def server_arguments(ap: argparse.ArgumentParser, gen: int) -> None:
    """The options that say what a3b serve runs (bench_chains takes them too)."""
    model_option(ap, help="GGUF file (default: the embedded model)")
    ap.add_argument("--gpu", action="store_true", help="every layer on the GPU (in both servers)")
    ap.add_argument("--token-prompts", action="store_true", help="prompts as token ids (a random-weight model)")
    ap.add_argument("--parallel", type=int, default=4, help="slots (of both servers)")
    ap.add_argument("--n-ctx", type=int, default=512, help="context per slot")
    ap.add_argument("--gen", type=int, default=gen, help="tokens per request")
    ap.add_argument("--a3b-args", default="", help="more options of a3b serve, e.g. '--speculative off'")


def main(argv=None) -> int:
    ap = arguments(__doc__)
    server_arguments(ap, gen=128)
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: built from the vendored "
                                                         "llama.cpp of the installed llama-cpp-python, once)")
    ap.add_argument("--clients", default="1,4", help="client counts (comma list)")
    ap.add_argument("--modes", default="greedy,t0.7", help="sampling modes: greedy, t0.7")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client and cell")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of both servers (0: each one's default)")
    ap.add_argument("--llama-server-threads", type=int, default=0,
                    help="llama-server's threads alone (-t; 0: --threads), e.g. the pinned cores' count")
    ap.add_argument("--cpus", default=None, help="run both servers on these cores only (taskset -c LIST): a small "
                                                 "machine's cores on a large one")
    ap.add_argument("--no-passes", dest="passes", action="store_false", help="skip the pass count run")
    ap.add_argument("--only", default="a3b serve,llama-server", help="which servers to run (comma list)")
    ap.add_argument("--out", default=None, help="also copy the results into this folder")
    results_options(ap, "serving")
    args = ap.parse_args(argv)
    if args.report:
        res = json.loads(Path(args.report).read_text())
        report(res, Path(args.report).stem)
        return 0
    args.model = str(model_path(args.model))
    log_dir = Path(args.out or "/tmp")
    log_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"args": vars(args), "command": "python -m comfyui_a3b.bench.bench_serving " +
                 " ".join(argv if argv is not None else sys.argv[1:])}
    for name, cmd, is_ls in (("a3b serve", a3b_cmd, False), ("llama-server", llama_server_cmd, True)):
        if name not in args.only.split(","):
            continue
        port = free_port()
        proc = Proc(cmd(args, port), f"http://127.0.0.1:{port}", log=log_dir / f"{name.replace(' ', '_')}.log")
        try:
            res[name] = measure(name, proc, args, is_ls)
            res[name]["command"] = " ".join(cmd(args, port))
        finally:
            proc.stop()
    if args.passes:
        res["passes"] = passes(args)
        print("passes:", res["passes"], flush=True)
    report(res, args.name, args.out)
    return 0


def _keep(path: Path, out: str | None) -> None:
    """The results folder may be a copy that goes away (a GPU machine's): each file in `out` too, as
    soon as it is written (a plot that fails there loses nothing measured)."""
    if out:
        shutil.copy2(path, Path(out) / path.name)


def report(res: dict, name: str, out: str | None = None) -> None:
    a, ls = res.get("a3b serve", {}).get("cells", {}), res.get("llama-server", {}).get("cells", {})
    rows = []
    for key in a:
        x, y = a[key], ls.get(key, {})
        ratio = x["aggregate_tps"] / y["aggregate_tps"] if y.get("aggregate_tps") else float("nan")
        rows.append([key, x["aggregate_tps"], y.get("aggregate_tps", float("nan")), ratio,
                     x["ttft_p50_ms"], x["ttft_p95_ms"], y.get("ttft_p50_ms"), y.get("ttft_p95_ms"),
                     x["cpu_s_per_1k_tokens"], y.get("cpu_s_per_1k_tokens"), x.get("loop_cpu_share", 0.0) * 100])
    print_table(f"a3b serve vs llama-server ({Path(res['args']['model']).name}, {res['args']['gen']} tokens a request)",
                ["mode/clients", "a3b tok/s", "llama-server tok/s", "x", "a3b TTFT p50 ms", "p95", "l-s TTFT p50 ms",
                 "p95", "a3b CPU-s/1k tok", "l-s CPU-s/1k tok", "a3b loop CPU %"], rows)
    summary = {key: a[key]["aggregate_tps"] / ls[key]["aggregate_tps"] for key in a if key in ls}
    res["ratios"] = summary
    _keep(write_results(name, res), out)

    def draw(ax):
        keys = list(a)
        xs = range(len(keys))
        ax.bar([i - 0.2 for i in xs], [a[k]["aggregate_tps"] for k in keys], 0.4, label="a3b serve")
        ax.bar([i + 0.2 for i in xs], [ls.get(k, {}).get("aggregate_tps", 0) for k in keys], 0.4, label="llama-server")
        for i, k in enumerate(keys):
            if k in summary:
                ax.annotate(f"{summary[k]:.2f}x", (i - 0.2, a[k]["aggregate_tps"]), ha="center", va="bottom",
                            fontsize=8)
        ax.set_xticks(list(xs), keys, rotation=30, fontsize=8)
        ax.set_ylabel("tokens/s, all clients")
        ax.set_title(f"{Path(res['args']['model']).name}: a3b serve vs llama-server", fontsize=9)
        ax.legend(fontsize=8)

    _keep(plot(name, draw), out)


if __name__ == "__main__":
    sys.exit(main())
