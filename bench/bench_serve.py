"""Serving over HTTP: the runtime in-process vs `a3b serve` vs llama_cpp.server, in one run.

    python -m comfyui_a3b.bench.bench_serve [--tokens 128] [--rounds 3] [--threads N]

Same embedded model, same prompts, greedy, 4 sequence slots where the server has slots. For each
of the three ways, one client (the median of `--rounds` requests) and four concurrent clients:

* decode tokens/s of a request (first to last streamed token) and the aggregate tokens/s of the
  four (all tokens over the wall time);
* time to first token, from sending the request to the first streamed token.

`a3b serve` and llama_cpp.server run as their own processes (`python -m comfyui_a3b.cli serve`,
`python -m llama_cpp.server --interrupt_requests false`, so that a second request waits instead of
cutting the first one off), one after the other, each measured from this process with streamed
/v1/completions requests; the in-process rows call `Runtime.submit` directly. Ratios are against
the in-process rows of the same run. Writes bench/results/serve.json and serve.png.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx

from .common import arguments, command, free_port, llama_cpp_server, median, plot, print_table, publish, ratio

PROMPT = ("Request {i}. The following is a long, detailed story about a lighthouse keeper who finds a "
          "message in a bottle, told chapter by chapter.\n\nChapter 1\n\n")


class Timing:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.n = 0

    def token(self) -> None:
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now
        self.n += 1

    @property
    def ttft(self) -> float:
        return (self.first or self.t0) - self.t0

    @property
    def tps(self) -> float:
        return (self.n - 1) / (self.last - self.first) if self.n > 1 and self.last > self.first else 0.0


def in_process(spec, i: int, n_tokens: int) -> Timing:
    from comfyui_a3b.runtime import get_runtime, preset

    t = Timing()
    for ev in get_runtime().submit(PROMPT.format(i=i), model=spec, chat=False, max_tokens=n_tokens,
                                   sampling=preset("greedy")):
        if ev.token >= 0:
            t.token()
    return t


def over_http(client: httpx.Client, url: str, i: int, n_tokens: int) -> Timing:
    """One streamed completion through `client`: one per client thread, made before any clock
    starts and kept, as real clients do (making one costs 20-80 ms, its SSL context, which would
    otherwise count as the server's time to first token)."""
    body = {"prompt": PROMPT.format(i=i), "max_tokens": n_tokens, "stream": True, "temperature": 0, "top_k": 1,
            "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
    t = Timing()
    with client.stream("POST", url + "/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if ev.get("choices") and ev["choices"][0].get("text"):
                    t.token()
    return t


def measure(call, n_tokens: int, rounds: int, first_id: int) -> dict:
    """`call(request id, tokens, client slot)`: one request, timed; slot 0 alone, then slots 0-3 at once."""
    call(first_id, 8, 0)   # warm-up: the model is loaded, the first request's costs are paid
    singles = [call(first_id + 1 + r, n_tokens, 0) for r in range(rounds)]
    out: list[Timing] = []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda k=k: out.append(call(first_id + 100 + k, n_tokens, k))) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    return {"one": {"decode_tps": median([s.tps for s in singles]), "ttft_s": median([s.ttft for s in singles]),
                    "tokens": median([s.n for s in singles])},
            "four": {"aggregate_tps": sum(o.n for o in out) / wall, "decode_tps": median([o.tps for o in out]),
                     "ttft_s": median([o.ttft for o in out]), "tokens": sum(o.n for o in out), "wall_s": wall}}


def wait_ready(url: str, proc: subprocess.Popen, deadline_s: float, headers: dict | None = None) -> None:
    """Until GET `url` answers 200; RuntimeError if `proc` exits first, TimeoutError after `deadline_s`."""
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url, headers=headers, timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {deadline_s} s")


def start(cmd: list[str], url: str, deadline_s: float = 120) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url + "/models", proc, deadline_s)
    except (RuntimeError, TimeoutError):
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


def ways(args) -> dict[str, dict]:
    """The embedded model in-process, behind `a3b serve` and behind llama_cpp.server, one after another."""
    from comfyui_a3b.runtime import default_model_path, get_runtime

    threads = ["--threads", str(args.threads)] if args.threads else []
    lcs_threads = ["--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)] if args.threads else []
    model = str(default_model_path())
    rt = get_runtime()
    spec = rt.spec(model, n_parallel=4, n_threads=args.threads)
    rt.load(spec)
    res: dict[str, dict] = {}
    res["in-process"] = measure(lambda i, n, k: in_process(spec, i, n), args.tokens, args.rounds, 0)
    rt.unload()   # the servers below get the cores and memory to themselves
    clients = [httpx.Client(timeout=300, trust_env=False) for _ in range(4)]   # one per client thread

    def http_way(url: str):
        return lambda i, n, k: over_http(clients[k], url, i, n)

    servers = {"a3b serve": lambda port: [sys.executable, "-m", "comfyui_a3b.cli", "serve", "--http",
                                          f"127.0.0.1:{port}", "--model", model, "--parallel", "4", *threads],
               "llama_cpp.server": lambda port: [*llama_cpp_server(), "--model", model, "--host", "127.0.0.1", "--port",
                                                 str(port), "--n_ctx", "2048", "--interrupt_requests", "false",
                                                 "--verbose", "false", *lcs_threads]}
    try:
        for (way, cmd), offset in zip(servers.items(), (1000, 2000)):
            port = free_port()
            url = f"http://127.0.0.1:{port}/v1"
            proc = start(cmd(port), url)
            try:
                res[way] = measure(http_way(url), args.tokens, args.rounds, offset)
            finally:
                stop(proc)
    finally:
        for c in clients:
            c.close()
    return res


def report(data: dict) -> None:
    res, base = data["results"], data["results"]["in-process"]
    rows = [[way, r["one"]["decode_tps"], ratio(r["one"]["decode_tps"], base["one"]["decode_tps"]),
             r["one"]["ttft_s"] * 1000, ratio(r["one"]["ttft_s"], base["one"]["ttft_s"]),
             r["four"]["aggregate_tps"], ratio(r["four"]["aggregate_tps"], base["four"]["aggregate_tps"]),
             r["four"]["ttft_s"] * 1000] for way, r in res.items()]
    print_table(f"SmolLM2-135M Q4_1, greedy, {data['tokens']} tokens a request (ratios: against in-process)",
                ["way", "1 client tok/s", "x", "1 client TTFT ms", "x", "4 clients aggregate tok/s", "x",
                 "4 clients TTFT ms (median)"], rows)
    print(json.dumps(data["summary"], indent=1))

    def draw(ax):
        names = list(res)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [res[w]["one"]["decode_tps"] for w in names], 0.4, label="1 client, tok/s")
        ax.bar([x + 0.2 for x in xs], [res[w]["four"]["aggregate_tps"] for w in names], 0.4,
               label="4 clients, aggregate tok/s")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("tokens/s")
        ax.set_title("SmolLM2-135M on 2 CPU cores: in-process vs a3b serve vs llama_cpp.server")
        ax.legend()

    plot("serve", draw)


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=9, help="single-client requests per way (the median is reported)")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads of every way (0: each one's automatic choice); on a machine shared with other "
                         "jobs, 1 avoids llama.cpp's threads spinning against each other")
    args = ap.parse_args(argv)
    res = ways(args)
    base, a3b, lcs = res["in-process"], res["a3b serve"], res["llama_cpp.server"]
    summary = {"a3b_serve_vs_in_process_1_client": a3b["one"]["decode_tps"] / base["one"]["decode_tps"],
               "a3b_serve_vs_llama_cpp_server_4_clients": a3b["four"]["aggregate_tps"] / lcs["four"]["aggregate_tps"]}
    data = {"tokens": args.tokens, "rounds": args.rounds, "threads": args.threads, "results": res,
            "summary": summary, "command": command("bench_serve", argv)}
    return publish("serve", data, report)


if __name__ == "__main__":
    sys.exit(main())
