"""Whether a hostile grammar or JSON schema stalls a concurrent short chat.

    python -m comfyui_a3b.bench.bench_grammar_stall [--before PATH] [--case-timeout 45] [--only NAME]

For each hostile request (a GBNF `grammar` of 500 / 2000 / 8000 / 50 000 alternatives; a
`json_schema` with minLength 10^8, an enum of 100 000 values, minItems 10^7; and, for reference, a
plain 64-token chat: what sharing the model with any answer costs), a fresh `a3b serve`
on the embedded model (2 slots) measures a 4-token greedy chat alone (the baseline, median of 3), then
sends the hostile request and, 0.3 s later, the same chat beside it. The figure is the ratio of the
chat's latency beside the hostile request to its latency alone, measured in the same server; and what
the hostile request got (its status and time). A chat or hostile request still unanswered after
--case-timeout seconds counts as that many seconds (the ratio is then a lower bound, marked ">=").

--before PATH runs the same cases against another checkout of the package (the code before a change,
e.g. `git worktree add /tmp/before <commit>`), served by that checkout, in the same run: rows "before"
and "after" (this checkout).

Writes bench/results/grammar_stall.json, grammar_stall.md and grammar_stall.png.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from .common import RESULTS, arguments, free_port, median, plot, print_table, write_results

HERE = Path(__file__).resolve().parent.parent
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
ASK = [{"role": "user", "content": "Answer."}]


def alternatives(n: int) -> dict:
    return {"messages": ASK, "max_tokens": 64, "grammar": "root ::= " + " | ".join(f'"w{i}x"' for i in range(n))}


def schema(s: dict) -> dict:
    return {"messages": ASK, "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}


CASES = {
    # the reference: what sharing the model with any 64-token answer costs the chat
    "plain 64 tokens (reference)": lambda: {"messages": ASK, "max_tokens": 64},
    "grammar 500 alternatives": lambda: alternatives(500),
    "grammar 2000 alternatives": lambda: alternatives(2000),
    "grammar 8000 alternatives": lambda: alternatives(8000),
    "grammar 50000 alternatives": lambda: alternatives(50_000),
    "minLength 1e8": lambda: schema({"type": "string", "minLength": 100_000_000}),
    "enum of 100000": lambda: schema({"enum": [f"value{i}" for i in range(100_000)]}),
    "minItems 1e7": lambda: schema({"type": "array", "minItems": 10_000_000, "items": {"type": "integer"}}),
}


class Server:
    """`a3b serve` of the package at `tree` (a checkout: its folder is imported as comfyui_a3b)."""

    def __init__(self, tree: Path):
        self.pkg = tempfile.TemporaryDirectory(prefix="a3b-bench-pkg-")
        os.symlink(tree, Path(self.pkg.name) / "comfyui_a3b")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": self.pkg.name}
        self.p = subprocess.Popen([sys.executable, "-m", "comfyui_a3b.cli", "serve", "--http",
                                   f"127.0.0.1:{self.port}", "--parallel", "2", "--quiet"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/v1/models", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.p.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"a3b serve from {tree} did not start")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self.pkg.cleanup()


def timed(base: str, body: dict, timeout: float) -> tuple[float, str]:
    """Seconds until the answer (or `timeout`) and what came: the status code or "timeout"."""
    t0 = time.perf_counter()
    try:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=timeout, trust_env=False)
        return time.perf_counter() - t0, str(r.status_code)
    except httpx.TimeoutException:
        return timeout, "timeout"


def one_case(tree: Path, body: dict, timeout: float) -> dict:
    srv = Server(tree)
    try:
        timed(srv.base, CHAT, timeout)   # warm-up
        alone = median([timed(srv.base, CHAT, timeout)[0] for _ in range(3)])
        bad: dict = {}

        def hostile() -> None:
            bad["s"], bad["status"] = timed(srv.base, body, timeout)

        t = threading.Thread(target=hostile, daemon=True)
        t.start()
        time.sleep(0.3)
        beside, chat_status = timed(srv.base, CHAT, timeout)
        t.join(timeout + 5)
        censored = chat_status == "timeout"
        return {"alone_s": alone, "beside_s": beside, "ratio": beside / alone, "censored": censored,
                "chat_status": chat_status, "hostile_status": bad.get("status", "timeout"),
                "hostile_s": bad.get("s", timeout)}
    finally:
        srv.stop()


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__)
    ap.add_argument("--before", type=Path, default=None, help="another checkout of the package to measure first")
    ap.add_argument("--case-timeout", type=float, default=45.0, help="seconds a request may take (default 45)")
    ap.add_argument("--only", action="append", default=None, help="run only these cases (repeatable)")
    args = ap.parse_args(argv)
    trees = ([("before", args.before.resolve())] if args.before else []) + [("after", HERE)]
    cases = [c for c in CASES if not args.only or c in args.only]
    rows, out = [], []
    for label, tree in trees:
        for name in cases:
            r = one_case(tree, CASES[name](), args.case_timeout)
            r.update(code=label, case=name)
            out.append(r)
            ratio = (">=" if r["censored"] else "") + f"{r['ratio']:.2g}"
            rows.append([label, name, r["alone_s"], r["beside_s"], ratio, r["hostile_status"], r["hostile_s"]])
            print_table("", ["code", "case", "chat alone s", "chat beside s", "ratio", "hostile got", "hostile s"],
                        rows[-1:])
    header = ["code", "case", "chat alone s", "chat beside s", "ratio", "hostile got", "hostile s"]
    print_table("A 4-token chat beside a hostile grammar request (ratio = beside / alone, same server)", header,
                rows)
    write_results("grammar_stall", {"case_timeout_s": args.case_timeout, "results": out})
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r) + " |" for r in rows]
    (RESULTS / "grammar_stall.md").write_text("\n".join(md) + "\n")

    def draw(ax) -> None:
        import numpy as np

        x = np.arange(len(cases))
        width = 0.8 / len(trees)
        for i, (label, _) in enumerate(trees):
            ys = [next(r["ratio"] for r in out if r["code"] == label and r["case"] == c) for c in cases]
            ax.bar(x + i * width, ys, width, label=label)
        ax.set_yscale("log")
        ax.axhline(1, color="grey", lw=0.8)
        ax.set_xticks(x + width * (len(trees) - 1) / 2)
        ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("4-token chat latency beside / alone")
        ax.set_title("A hostile grammar request beside a short chat")
        ax.legend()

    plot("grammar_stall", draw, size=(8, 4.5))


if __name__ == "__main__":
    main()
