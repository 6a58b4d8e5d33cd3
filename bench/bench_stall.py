"""Whether one client can stall another, and how fast work stops for a client that left.

    python -m comfyui_a3b.bench.bench_stall [--rounds 3] [--short 5]

`a3b serve` runs in this process on the embedded model. Three measurements, each against a
baseline taken in the same run:

* **stall**: the latency of a short request (4 tokens, greedy) alone, beside a long streamed request
  (600 tokens), and beside the same long request carrying a 1 MiB stop string. The stop string must
  cost nothing beyond sharing the model (ratio "1 MiB stop / no stop" near 1); sharing itself costs
  what the batched decode costs.
* **cancel**: a client sends a non-streamed request (a long /v1/completions, a long /infill) over a
  raw socket and closes it once the model is busy; the time until the model is idle again.

Writes bench/results/stall.json and stall.png.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from .common import arguments, median, percentile, plot, print_table, write_results

LONG = {"prompt": "Once upon a time", "max_tokens": 600, "stream": True, "temperature": 0}


def short_latency(client: httpx.Client) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


def beside(base: str, client: httpx.Client, n: int, stop: list[str] | None) -> list[float]:
    """`n` short requests while a long stream runs (with `stop` as its stop strings)."""
    box: dict[str, float] = {}

    def long() -> None:
        body = dict(LONG, **({"stop": stop} if stop else {}))
        with httpx.Client(base_url=base, timeout=600, trust_env=False) as c2, \
                c2.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    box.setdefault("first", time.monotonic())
        box["end"] = time.monotonic()

    t = threading.Thread(target=long, daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while "first" not in box and time.monotonic() < deadline:
        time.sleep(0.01)
    xs = [short_latency(client) for _ in range(n)]
    overlapped = "end" not in box
    t.join(timeout=600)
    return xs if overlapped else []


def cancel_time(port: str, path: str, body: dict, model) -> float | None:
    """Seconds from closing the socket of a non-streamed request until the model is idle (None when
    the request had ended before the socket closed: nothing to measure)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    deadline = time.monotonic() + 60
    while not model.busy() and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.3)   # well into decoding
    if not model.busy():
        s.close()
        return None
    s.close()
    t0 = time.monotonic()
    while model.busy() and time.monotonic() < t0 + 60:
        time.sleep(0.002)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each measurement (default 3)")
    ap.add_argument("--short", type=int, default=5, help="short requests per round (default 5)")
    args = ap.parse_args(argv)

    from ..runtime import get_runtime
    from ..serve import Server

    rt = get_runtime()
    spec = rt.spec(None)
    srv = Server(spec, "127.0.0.1", 0, access_log=False).start()
    model = rt.load(spec)
    base = f"http://127.0.0.1:{srv.port}"
    stall = {"alone": [], "beside, no stop": [], "beside, 1 MiB stop": []}
    cancels = {"/v1/completions": [], "/infill": []}
    try:
        with httpx.Client(base_url=base, timeout=600, trust_env=False) as client:
            short_latency(client)   # warm
            for _ in range(args.rounds):
                stall["alone"] += [short_latency(client) for _ in range(args.short)]
                stall["beside, no stop"] += beside(base, client, args.short, None)
                stall["beside, 1 MiB stop"] += beside(base, client, args.short, ["q" * (1 << 20)])
                cancels["/v1/completions"] += filter(None, [cancel_time(
                    srv.port, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 600,
                                                  "temperature": 0}, model)])
                cancels["/infill"] += filter(None, [cancel_time(
                    srv.port, "/infill", {"input_prefix": "Once upon a time", "input_suffix": "",
                                          "n_predict": 600, "temperature": 0}, model)])
    finally:
        srv.stop()

    alone = median(stall["alone"])
    rows = [[k, len(v), median(v) * 1000, percentile(v, 0.95) * 1000, median(v) / alone] for k, v in stall.items()]
    print_table("Short request latency (4 tokens)", ["case", "n", "p50 ms", "p95 ms", "x alone"], rows)
    crow = [[k, len(v), median(v) * 1000, max(v) * 1000] for k, v in cancels.items()]
    print_table("Time to idle after a non-streamed client leaves", ["endpoint", "n", "p50 ms", "max ms"], crow)
    ratio = median(stall["beside, 1 MiB stop"]) / median(stall["beside, no stop"])
    print(f"1 MiB stop string / no stop string, beside a long request: {ratio:.2f}x")
    write_results("stall", {"args": vars(args), "stall_s": stall, "cancel_s": cancels,
                            "stop_vs_no_stop": ratio})

    def draw(ax):
        names = [f"short, {k}" for k in stall] + [f"cancel {k}" for k in cancels]
        values = [median(v) * 1000 for v in stall.values()] + [median(v) * 1000 for v in cancels.values()]
        ax.bar(range(len(names)), values, color=["C0"] * len(stall) + ["C1"] * len(cancels))
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.axhline(500, linestyle="--", color="grey", linewidth=0.8)
        ax.set_ylabel("ms (p50)")
        ax.set_title("Short-request latency beside a long one; time to idle after a client leaves")
    plot("stall", draw, size=(9, 4.5))


if __name__ == "__main__":
    main()
