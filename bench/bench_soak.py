"""Soak: one process serving a ComfyUI-style workflow loop and four editors at once, with unloads.

What runs, for `--minutes` (default 10) on the embedded default model, in a child process (so a crash
is counted, not fatal to the benchmark):

* a workflow loop: A3BGenerate's code path (`nodes.generation.generate`), 48-token answers one after
  another at batch priority, as a ComfyUI queue would;
* four editors, each a JSON-RPC client of the in-process language server over TCP (as with
  A3B_LSP inside ComfyUI). Each retypes functions of a standard-library module at about 65 words per
  minute, asks for an inline completion at every pause (75 ms, like an editor's debounce) and cancels
  the pending request at the next keystroke ($/cancelRequest). During the first fifth of the run
  the editors have only their own file open (the baseline); then each opens 30 more standard-library
  files, so context indexing runs beside the typing;
* every 45 s, all models are unloaded (ComfyUI's "Unload models"); the next request reloads.

Reported: requests served and answered, errors by type, completion latency p50/p95 with no other
files open and with 30 (and their ratio: the target is at most 2x), workflow generations, RSS after
warm-up, at its peak and right after each unload (the resident size saws up and down by about 25%
with each unload and reload, so growth compares the moments just after unloads: the median of the
first three once every editor has its files open and of the last three; target: less than 5%),
whether the process survived. Separately, the
first-load cost of crash isolation (runtime/models/vet.py): a first load of the default model in a fresh
process with vetting on vs off, median of several runs.

Before it, the editor scenario (bench/soak_editor.py, a few minutes): completion latency p50/p95 of
a fresh language server while real files are opened one after another, vs each file alone
(bench/results/soak_editor.json, soak_editor.png).

    python -m comfyui_a3b.bench.bench_soak [--minutes 10] [--vet-runs 5] [--scenario all|soak|editor]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import importlib
import inspect
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

from . import soak_editor
from .common import arguments, median, percentile, plot, print_table, write_results

EDITORS = 4
OTHER_FILES = 30
DEBOUNCE_S = 0.075
UNLOAD_EVERY_S = 45.0
MODULES = ["textwrap", "shlex", "fnmatch", "glob", "calendar", "csv", "difflib", "ftplib", "gettext", "heapq",
           "imaplib", "inspect", "ipaddress", "json.decoder", "locale", "mailbox", "netrc", "optparse", "pathlib",
           "pickle", "platform", "pprint", "queue", "quopri", "random", "sched", "selectors", "smtplib",
           "statistics", "string", "tarfile", "tempfile", "threading", "tokenize", "trace", "uuid", "wave",
           "zipfile", "argparse", "base64"]


# -- a minimal LSP client over TCP --------------------------------------------------------------
class Client:
    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.next_id = 0
        self.waiting: dict[int, asyncio.Future] = {}
        self.sent_at: dict[int, float] = {}
        self.task = asyncio.ensure_future(self._read())

    @classmethod
    async def connect(cls, port: int) -> Client:
        r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 26)
        return cls(r, w)

    def _send(self, msg: dict) -> None:
        body = json.dumps(msg).encode()
        self.writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def notify(self, method: str, params) -> None:
        self._send({"jsonrpc": "2.0", "method": method, "params": params})

    def request(self, method: str, params) -> tuple[int, asyncio.Future]:
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = fut
        self.sent_at[self.next_id] = time.monotonic()
        self._send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        return self.next_id, fut

    def cancel(self, msg_id: int) -> None:
        self.notify("$/cancelRequest", {"id": msg_id})

    async def _read(self) -> None:
        try:
            while True:
                n = None
                while True:
                    line = await self.reader.readline()
                    if not line:
                        raise ConnectionError("server closed the connection")
                    if line in (b"\r\n", b"\n"):
                        break
                    k, _, v = line.decode().partition(":")
                    if k.strip().lower() == "content-length":
                        n = int(v)
                msg = json.loads(await self.reader.readexactly(n))
                if "method" in msg and "id" in msg:           # a server request: answer it
                    self._send({"jsonrpc": "2.0", "id": msg["id"], "result": None})
                elif "id" in msg and msg["id"] in self.waiting:
                    fut = self.waiting.pop(msg["id"])
                    if not fut.done():
                        fut.set_result(msg)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(str(e)))

    async def close(self) -> None:
        self.task.cancel()
        self.writer.close()


def source(module: str) -> str:
    return inspect.getsource(importlib.import_module(module))


def typing_script(module: str, rng: random.Random) -> tuple[str, str, str]:
    """(before, typed, after): a function from the second half of `module`, to be retyped."""
    src = source(module)
    lines = src.split("\n")
    defs = [i for i, ln in enumerate(lines) if ln.startswith(("def ", "    def ")) and i > len(lines) // 2]
    i = rng.choice(defs) if defs else len(lines) // 2
    start = sum(len(ln) + 1 for ln in lines[:i])
    body = src[start:start + 400]
    body = body[:body.rfind("\n") + 1] or body
    return src[:start], body, src[start + len(body):]


def position(text: str, offset: int) -> dict:
    line = text.count("\n", 0, offset)
    return {"line": line, "character": offset - (text.rfind("\n", 0, offset) + 1)}


async def editor(k: int, port: int, stop_at: float, phase_at: float, out: dict) -> None:
    rng = random.Random(1000 + k)
    c = await Client.connect(port)
    _, fut = c.request("initialize", {"processId": None, "rootUri": None, "capabilities": {},
                                      "initializationOptions": {}})   # the server's own settings
    await fut
    c.notify("initialized", {})
    mine = MODULES[k]
    uri = f"file:///soak/editor{k}/{mine}.py"
    opened_others = False
    version = 1
    pending: tuple[int, asyncio.Future] | None = None
    while time.monotonic() < stop_at:
        before, typed, after = typing_script(mine, rng)
        text = before + after
        version += 1
        c.notify("textDocument/didOpen" if version == 2 else "textDocument/didChange",
                 {"textDocument": {"uri": uri, "languageId": "python", "version": version, "text": text}}
                 if version == 2 else
                 {"textDocument": {"uri": uri, "version": version}, "contentChanges": [{"text": text}]})
        offset = len(before)
        for ch in typed:
            now = time.monotonic()
            if now >= stop_at:
                break
            if not opened_others and now >= phase_at:
                opened_others = True
                for j in range(OTHER_FILES):
                    m = MODULES[(k * 7 + j + 4) % len(MODULES)]
                    c.notify("textDocument/didOpen", {"textDocument": {
                        "uri": f"file:///soak/editor{k}/other/{m}.py", "languageId": "python", "version": 1,
                        "text": source(m)}})
            phase = "with_files" if opened_others else "alone"
            if pending is not None:
                c.cancel(pending[0])          # a keystroke: the pending request is outdated
                pending = None
            version += 1
            pos = position(text, offset)
            c.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": version},
                                                "contentChanges": [{"range": {"start": pos, "end": pos}, "text": ch}]})
            text = text[:offset] + ch + text[offset:]
            offset += 1
            dt = rng.lognormvariate(-1.85, 0.45) + (rng.uniform(0.3, 0.8) if ch == "\n" else 0.0)
            if dt > DEBOUNCE_S:
                await asyncio.sleep(DEBOUNCE_S)
                msg_id, f = c.request("textDocument/inlineCompletion", {
                    "textDocument": {"uri": uri}, "position": position(text, offset), "context": {"triggerKind": 2}})
                out["requests"][phase] += 1
                pending = (msg_id, f)
                try:
                    res = await asyncio.wait_for(asyncio.shield(f), dt - DEBOUNCE_S)
                except asyncio.TimeoutError:
                    continue                    # the next keystroke comes first; it cancels this one
                except ConnectionError as e:
                    out["errors"][f"disconnected: {e}"] += 1
                    return
                pending = None
                if "error" in res:
                    code = res["error"].get("code")
                    if code != -32800:          # RequestCancelled is the expected end of a stale request
                        out["errors"][f"lsp {code}: {res['error'].get('message', '')[:60]}"] += 1
                    continue
                out["latency"][phase].append(time.monotonic() - c.sent_at.pop(msg_id))
                out["answered"][phase] += 1
            else:
                await asyncio.sleep(dt)
    await c.close()


async def editors(port: int, seconds: float, out: dict) -> None:
    t0 = time.monotonic()
    await asyncio.gather(*(editor(k, port, t0 + seconds, t0 + seconds / 5, out) for k in range(EDITORS)))


def child(minutes: float) -> dict:
    import psutil

    from ..lsp_server import inprocess
    from ..nodes import core as nodes, generation
    from ..runtime import A3BError, get_runtime

    rt = get_runtime()
    proc = psutil.Process()
    spec = nodes.load_model()
    generation.generate(spec, "Say hello.", max_new_tokens=8)         # warm-up
    info = inprocess.maybe_start({"A3B_LSP": "tcp:127.0.0.1:0"})
    port = int(info["address"].rsplit(":", 1)[1])
    rss_start = proc.memory_info().rss
    seconds = minutes * 60
    stop = threading.Event()
    out = {"requests": collections.Counter(), "answered": collections.Counter(), "errors": collections.Counter(),
           "latency": {"alone": [], "with_files": []}, "workflow": 0, "unloads": 0}

    def workflow() -> None:
        prompts = ["Write a two-line poem about the sea.", "Describe a robot in one sentence.",
                   "Name three fruits.", "Give a title for a comic about cats."]
        i = 0
        while not stop.is_set():
            try:
                generation.generate(spec, prompts[i % len(prompts)], max_new_tokens=48,
                               sampling=generation.sampling_params(seed=i))
                out["workflow"] += 1
            except A3BError as e:
                if type(e).__name__ != "ModelUnloaded":
                    out["errors"][f"workflow {type(e).__name__}"] += 1
            except Exception as e:  # noqa: BLE001 - counted: the soak reports every failure
                out["errors"][f"workflow bug {type(e).__name__}: {e}"] += 1
            i += 1

    after_unloads: list[tuple[float, int]] = []

    def unloader() -> None:
        t0 = time.monotonic()
        while not stop.wait(UNLOAD_EVERY_S):
            with rt.store.loads_held():     # nobody reloads until the reading is taken
                rt.unload()
                out["unloads"] += 1
                # the one moment alike across the run: no model loaded, freed memory returned
                after_unloads.append((time.monotonic() - t0, proc.memory_info().rss))

    rss_series: list[tuple[float, int]] = []

    def sampler() -> None:
        t0 = time.monotonic()
        while not stop.wait(5.0):
            rss_series.append((time.monotonic() - t0, proc.memory_info().rss))

    threads = [threading.Thread(target=f, daemon=True) for f in (workflow, unloader, sampler)]
    for t in threads:
        t.start()
    asyncio.run(editors(port, seconds, out))
    stop.set()
    for t in threads:
        t.join(60)
    rss_end = proc.memory_info().rss
    # Resident size saws up and down by about 25% with every unload and reload (the model's mapped
    # file and its contexts come and go), so growth is read at the one moment that is alike across
    # the run: right after an unload. It compares the median of the first three such moments once
    # every editor has its 30 files open with the median of the last three.
    steady = [r for t, r in after_unloads if t >= seconds * 0.3]
    rss_first = median(steady[:3]) if steady else rss_end
    rss_last = median(steady[-3:]) if steady else rss_end
    lsp = inprocess.status()
    inprocess.stop()
    return {"minutes": minutes, "requests": dict(out["requests"]), "answered": dict(out["answered"]),
            "errors": dict(out["errors"]), "latency_s": out["latency"], "workflow_generations": out["workflow"],
            "unloads": out["unloads"], "rss_after_warmup": rss_start, "rss_first_third": rss_first,
            "rss_last_third": rss_last, "rss_end": rss_end, "rss_series": rss_series,
            "rss_after_unloads": after_unloads, "rss_peak": max([r for _, r in rss_series], default=rss_end),
            "server_counters": lsp.get("stats", {}).get("counters", {})}


def vet_cost(runs: int) -> dict:
    """First load of the default model in a fresh process: vetting on (no cached verdict) vs off."""
    code = ("import time, sys\nfrom comfyui_a3b.runtime import Runtime\nrt = Runtime()\nt0 = time.perf_counter()\n"
            "rt.load()\nprint(time.perf_counter() - t0)\n")
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(runs):
        for mode in ("off", "on"):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "A3B_CACHE": cache, "A3B_VET": mode}
                p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
                times[mode].append(float(p.stdout.strip().splitlines()[-1]))
    return {"runs": runs, "load_s_vet_off": times["off"], "load_s_vet_on": times["on"],
            "median_off": median(times["off"]), "median_on": median(times["on"])}


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--vet-runs", type=int, default=5)
    ap.add_argument("--scenario", choices=("all", "soak", "editor"), default="all",
                    help="the soak, the editor scenario (bench/soak_editor.py), or both")
    ap.add_argument("--editor-files", type=int, default=6, help="files the editor scenario opens")
    ap.add_argument("--editor-rounds", type=int, default=2, help="runs of each mode of the editor scenario")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("SOAK-RESULT " + json.dumps(child(args.minutes)), flush=True)
        return 0
    if args.scenario in ("all", "editor"):
        editor_scenario(args)
    return soak(args) if args.scenario in ("all", "soak") else 0


def editor_scenario(args) -> None:
    res = soak_editor.run(args.editor_files, args.editor_rounds)
    print_table(f"Soak, editor scenario: {args.editor_files} files, {args.editor_rounds} runs of each mode, each "
                "in a fresh `a3b lsp --stdio` with the default settings (each file alone / opened one after "
                "another)", ["measure", "value"],
                soak_editor.rows(res))
    write_results("soak_editor", {"args": vars(args), **res})
    plot("soak_editor", soak_editor.draw(res))


def soak(args) -> int:
    vet = vet_cost(args.vet_runs)
    p = subprocess.run([sys.executable, "-m", "comfyui_a3b.bench.bench_soak", "--child",
                        "--minutes", str(args.minutes)],
                       capture_output=True, text=True, timeout=args.minutes * 60 + 600)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("SOAK-RESULT ")), None)
    crashed = p.returncode != 0 or line is None
    res = json.loads(line[len("SOAK-RESULT "):]) if line else {}
    lat = res.get("latency_s", {"alone": [], "with_files": []})
    p95 = {k: percentile(v, 0.95) for k, v in lat.items()}
    p50 = {k: percentile(v, 0.5) for k, v in lat.items()}
    growth = (res["rss_last_third"] / res["rss_first_third"] - 1) if res else float("nan")
    rows = [
        ["completion requests (no other files / 30 files)", f"{res.get('requests', {}).get('alone', 0)} / "
                                                            f"{res.get('requests', {}).get('with_files', 0)}"],
        ["answered before the next keystroke", f"{res.get('answered', {}).get('alone', 0)} / "
                                               f"{res.get('answered', {}).get('with_files', 0)}"],
        ["completion p50 (no other files / 30 files), ms",
         f"{p50['alone'] * 1000:.0f} / {p50['with_files'] * 1000:.0f}"],
        ["completion p95 (no other files / 30 files), ms",
         f"{p95['alone'] * 1000:.0f} / {p95['with_files'] * 1000:.0f}"],
        ["p95 ratio, 30 files / none (target <= 2)",
         p95["with_files"] / p95["alone"] if p95["alone"] else float("nan")],
        ["workflow generations", res.get("workflow_generations", 0)],
        ["unloads (each followed by a reload)", res.get("unloads", 0)],
        ["errors", sum(res.get("errors", {}).values()) if res else "n/a"],
        ["RSS after warm-up / peak / at the end, MB",
         f"{res.get('rss_after_warmup', 0) / 2**20:.0f} / {res.get('rss_peak', 0) / 2**20:.0f} / "
         f"{res.get('rss_end', 0) / 2**20:.0f}"],
        ["RSS right after an unload: first three / last three (medians), MB",
         f"{res.get('rss_first_third', 0) / 2**20:.0f} / {res.get('rss_last_third', 0) / 2**20:.0f}"],
        ["RSS growth between those (target < 5%)", f"{growth * 100:.1f}%"],
        ["process survived", "no" if crashed else "yes"],
        ["first load, vetting off -> on (median), ms",
         f"{vet['median_off'] * 1000:.0f} -> {vet['median_on'] * 1000:.0f}"],
    ]
    print_table(f"Soak: {args.minutes:g} min, {EDITORS} editors, a workflow loop, unloads every {UNLOAD_EVERY_S:g} s",
                ["measure", "value"], rows)
    for err, n in sorted(res.get("errors", {}).items(), key=lambda kv: -kv[1]):
        print(f"  error x{n}: {err}")
    sc = res.get("server_counters", {})
    print(f"  completions that ended without text because their model was unloaded or failed: "
          f"{sc.get('generations_failed', 0)} (told to the editor with window/showMessage)")
    if crashed:
        print(p.stderr[-3000:])
    write_results("soak", {"args": vars(args), "result": res, "crashed": crashed, "exit_code": p.returncode,
                           "p50_s": p50, "p95_s": p95, "rss_growth": growth, "vet": vet})

    def draw(ax):
        for name, xs in lat.items():
            if xs:
                s = sorted(xs)
                ax.plot([x * 1000 for x in s], [i / len(s) for i in range(len(s))],
                        label="no other files" if name == "alone" else f"{OTHER_FILES} other files open")
        ax.set_xscale("log")
        ax.set_xlabel("completion latency (ms, answered requests)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("Soak: completion latency beside a workflow loop and unloads")
        ax.legend()
    plot("soak", draw)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
