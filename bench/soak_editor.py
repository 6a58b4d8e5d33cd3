"""The soak's editor scenario: inline completions while files are being opened, as an editor user
meets it, against the same requests with no other file open.

A fresh `a3b lsp --stdio` with the default settings and the embedded default model, for each of two
modes, on the same real third-party source files (1-7 KB each, from the installed pygls package)
and the same completion requests: one at an indented line that opens a block right after its file
is opened, then one more in each file at a later such line.

* `opened`: the files are opened one after another and stay open, so each completion after the
  first starts context indexing (embeddings of the other files' chunks, batch priority) and prompt
  warming beside it: the completions must not wait behind that work;
* `alone`: the file a request is in is the only one open (the one before is closed first), so
  there is nothing to index: the baseline.

Each mode runs twice by default (alone, opened, opened, alone). Reported per mode: completion
latency p50/p95, requests not answered within ANSWER_WITHIN_S, and the texts embedded (the
indexing the mode caused). Run by `bench_soak --scenario editor`.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from lsprotocol import types as T

from .common import percentile

#: a request not answered in this time is counted as unanswered (and its latency left out)
ANSWER_WITHIN_S = 120.0
MODES = ("alone", "opened")
SERVER = [sys.executable, "-m", "comfyui_a3b.cli", "lsp", "--stdio"]


def block_openers(text: str) -> list[tuple[int, int]]:
    """(line, character) at the end of indented lines that open a block (`if ...:`, `def ...:`),
    from the first third of the file on: where an editor user asks for the block's body."""
    lines = text.split("\n")
    return [(i, len(ln)) for i, ln in enumerate(lines) if i >= len(lines) // 3 and ln.startswith("    ")
            and ln.rstrip().endswith(":") and not ln.lstrip().startswith("#")]


def third_party_sources(n: int) -> list[tuple[str, str]]:
    """(file URI, text) of the first `n` source files of the installed pygls package (by path) of
    1-7 KB with at least two places to complete at."""
    import pygls

    root = Path(pygls.__file__).resolve().parent
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if 1000 <= len(text.encode()) <= 7000 and len(block_openers(text)) >= 2:
            out.append((f"file:///soak/editor/{path.relative_to(root.parent).as_posix()}", text))
    if len(out) < n:
        raise SystemExit(f"only {len(out)} pygls source files fit the editor scenario; ask for fewer")
    return out[:n]


async def run_mode(mode: str, sources: list[tuple[str, str]]) -> dict:
    from pytest_lsp import client_capabilities
    from pytest_lsp.client import make_test_lsp_client

    client = make_test_lsp_client()
    await client.start_io(*SERVER)
    try:
        await client.initialize_session(T.InitializeParams(capabilities=client_capabilities("visual-studio-code")))
        requests = [(k, block_openers(text)[0]) for k, (_, text) in enumerate(sources)]
        requests += [(k, block_openers(text)[-1]) for k, (_, text) in enumerate(sources)]
        opened: set[int] = set()
        per_request: list[float | None] = []     # None: not answered in time
        for k, (line, character) in requests:
            uri, text = sources[k]
            if mode == "alone":
                for j in opened - {k}:
                    client.text_document_did_close(T.DidCloseTextDocumentParams(T.TextDocumentIdentifier(
                        sources[j][0])))
                opened &= {k}
            if k not in opened:
                client.text_document_did_open(T.DidOpenTextDocumentParams(
                    T.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)))
                opened.add(k)
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(client.text_document_inline_completion_async(T.InlineCompletionParams(
                    text_document=T.TextDocumentIdentifier(uri), position=T.Position(line, character),
                    context=T.InlineCompletionContext(trigger_kind=T.InlineCompletionTriggerKind.Automatic))),
                    ANSWER_WITHIN_S)
                per_request.append(time.perf_counter() - t0)
            except asyncio.TimeoutError:
                per_request.append(None)
        st = await asyncio.wait_for(client.workspace_execute_command_async(
            T.ExecuteCommandParams(command="a3b.status")), ANSWER_WITHIN_S)
        stats = st["runtime"]["models"][0].get("stats", {})
        try:
            await asyncio.wait_for(client.shutdown_session(), 30)
        except asyncio.TimeoutError:
            pass
    finally:
        await client.stop()
    return {"latency_s": per_request, "embedded_texts": stats.get("embedded_texts", 0), "model_stats": stats,
            "server_counters": st["server"].get("counters", {})}


def run(files: int, rounds: int = 2) -> dict:
    """Each mode `rounds` times, each time in a fresh server, in the order alone, opened, opened,
    alone, ... (the load of a shared machine drifts: this order spreads a drift over both modes);
    the latencies of a mode's runs pooled."""
    sources = third_party_sources(files)
    out: dict = {"files": [uri for uri, _ in sources], "answer_within_s": ANSWER_WITHIN_S, "rounds": rounds}
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            runs[mode].append(asyncio.run(run_mode(mode, sources)))
    for mode, rs in runs.items():
        lat = [x for r in rs for x in r["latency_s"]]
        answered = [x for x in lat if x is not None]
        out[mode] = {"latency_s": lat, "requests": len(lat), "unanswered": lat.count(None),
                     "embedded_texts": sum(r["embedded_texts"] for r in rs),
                     "p50_s": percentile(answered, 0.5), "p95_s": percentile(answered, 0.95), "runs": rs}
    return out


def rows(res: dict) -> list[list]:
    a, o = res["alone"], res["opened"]
    return [
        ["completion requests (each file alone / opened one after another)", f"{a['requests']} / {o['requests']}"],
        [f"not answered within {res['answer_within_s']:g} s", f"{a['unanswered']} / {o['unanswered']}"],
        ["completion p50, s", f"{a['p50_s']:.2f} / {o['p50_s']:.2f}"],
        ["completion p95, s", f"{a['p95_s']:.2f} / {o['p95_s']:.2f}"],
        ["p95 ratio, opened one after another / alone", o["p95_s"] / a["p95_s"] if a["p95_s"] else float("nan")],
        ["texts embedded for context", f"{a['embedded_texts']} / {o['embedded_texts']}"],
    ]


def draw(res: dict):
    def on(ax):
        for mode, label in (("alone", "each file alone"), ("opened", "files opened one after another")):
            xs = [(i, x) for i, x in enumerate(res[mode]["latency_s"], 1) if x is not None]
            ax.plot([i for i, _ in xs], [x for _, x in xs], marker="o", label=label)
        ax.set_xlabel("completion request, in order (the runs of a mode one after another)")
        ax.set_ylabel("latency (s)")
        ax.set_title("Editor scenario: completions while files are opened vs alone")
        ax.legend()
    return on
