"""Typing replay: inline completion latency of the language server vs the same requests sent
straight to the runtime, on the embedded default model, in one run.

A typist replays functions of real standard-library Python files character by character (seeded
inter-key intervals of about 65 words per minute, longer pauses at line ends). Like VS Code, the
client asks for an inline completion once the typist has paused for the debounce time, and cancels
the pending request ($/cancelRequest) at the next keystroke.

* server: `a3b lsp --stdio` with its cache, latest-request-wins and typed-ahead joining;
* baseline: each of those requests, at the same moment, submitted to the runtime directly (same
  prompt layout, so the runtime's KV prefix reuse still applies), with no cache and no
  cancellation, as a server without those features would.

Reported: p50/p95/p99 latency of answered requests (single-line and multi-line), cache hit rate,
and wasted decode work (decoded tokens whose result nobody saw, over all decoded tokens).

    python -m comfyui_a3b.bench.bench_lsp [--files textwrap,shlex,fnmatch] [--chars 260]
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import random
import sys
import threading
import time

from lsprotocol import types as T

from .common import arguments, percentile, plot, print_table, write_results

DEBOUNCE_S = 0.075     # client-side pause before asking, like an editor's inline-suggest debounce


def pick_region(module: str, chars: int) -> tuple[str, str, str]:
    """(before, typed, after): the start of a function from the middle of a stdlib module, about
    `chars` long, typed on an empty line of its own (the code below it stays in place)."""
    src = inspect.getsource(importlib.import_module(module))
    lines = src.split("\n")
    defs = [i for i, ln in enumerate(lines) if ln.startswith(("def ", "    def ")) and i > len(lines) // 3]
    start = sum(len(ln) + 1 for ln in lines[:defs[0]])
    body = src[start:start + chars]
    body = body[:body.rfind("\n") + 1] or body
    return src[:start], body.rstrip("\n"), "\n" + src[start + len(body):]


def schedule(text: str, rng: random.Random) -> list[float]:
    """Inter-key intervals (s): lognormal around 0.17 s, longer after newlines and punctuation."""
    out = []
    prev = ""
    for ch in text:
        dt = rng.lognormvariate(-1.85, 0.45)
        if prev == "\n":
            dt += rng.uniform(0.3, 0.8)      # thinking about the next line
        elif prev in ".,:()":
            dt += rng.uniform(0.02, 0.12)
        out.append(dt)
        prev = ch
    return out


def position(text: str, offset: int) -> T.Position:
    line = text.count("\n", 0, offset)
    col = offset - (text.rfind("\n", 0, offset) + 1)
    return T.Position(line=line, character=col)


async def replay_server(files, rng_seed: int, server_cmd: list[str]) -> dict:
    from pytest_lsp import client_capabilities
    from pytest_lsp.client import make_test_lsp_client

    from ..lsp_server.documents import Document
    from ..lsp_server.prompt import is_multiline

    client = make_test_lsp_client()
    await client.start_io(*server_cmd)
    await client.initialize_session(T.InitializeParams(capabilities=client_capabilities("visual-studio-code"),
                                                       initialization_options={"debounceMs": 0, "contextChunks": 0}))
    st0 = await client.workspace_execute_command_async(T.ExecuteCommandParams(command="a3b.status"))
    records: list[dict] = []
    requests: list[tuple] = []   # (t, uri, text, offset) for the baseline
    t_origin = time.perf_counter()
    for fi, (name, before, typed, after) in enumerate(files):
        rng = random.Random(rng_seed + fi)
        uri = f"file:///bench/{name}.py"
        text = before + after
        client.text_document_did_open(T.DidOpenTextDocumentParams(
            T.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)))
        await asyncio.sleep(0.3)
        offset = len(before)
        pending: list = []   # [future, record]
        gaps = schedule(typed, rng)
        for k, ch in enumerate(typed):
            pos = position(text, offset)
            if pending:      # the next keystroke: the editor cancels what it asked before
                fut, rec, mid = pending.pop()
                if not fut.done():
                    client.cancel_request(T.CancelParams(id=mid))
            client.text_document_did_change(T.DidChangeTextDocumentParams(
                text_document=T.VersionedTextDocumentIdentifier(uri=uri, version=k + 2),
                content_changes=[T.TextDocumentContentChangePartial(range=T.Range(pos, pos), text=ch)]))
            text = text[:offset] + ch + text[offset:]
            offset += 1
            gap = gaps[k + 1] if k + 1 < len(typed) else 1.0
            if gap < DEBOUNCE_S:
                await asyncio.sleep(gap)
                continue
            await asyncio.sleep(DEBOUNCE_S)
            pos = position(text, offset)
            doc = Document(uri, text, 0, "python")
            multi = is_multiline(doc.cursor(pos, "utf-16"))
            mid = f"r{len(records)}"
            rec = {"t": time.perf_counter() - t_origin, "multiline": multi, "file": name}
            requests.append((rec["t"], text, offset, multi, rec["t"] + gap - DEBOUNCE_S))
            t0 = time.perf_counter()

            def done(f, rec=rec, t0=t0):
                rec["latency_ms"] = (time.perf_counter() - t0) * 1000
                if f.cancelled() or f.exception() is not None:
                    rec["cancelled"] = True
                else:
                    r = f.result()
                    rec["suggestion"] = bool(r and r.items)

            fut = asyncio.ensure_future(client.protocol.send_request_async(
                "textDocument/inlineCompletion", T.InlineCompletionParams(
                    text_document=T.TextDocumentIdentifier(uri), position=pos,
                    context=T.InlineCompletionContext(trigger_kind=T.InlineCompletionTriggerKind.Automatic)),
                msg_id=mid))
            fut.add_done_callback(done)
            records.append(rec)
            pending.append((fut, rec, mid))
            await asyncio.sleep(gap - DEBOUNCE_S)
        await asyncio.sleep(1.5)
        client.text_document_did_close(T.DidCloseTextDocumentParams(T.TextDocumentIdentifier(uri)))
    st1 = await client.workspace_execute_command_async(T.ExecuteCommandParams(command="a3b.status"))
    await client.shutdown_session()
    await client.stop()
    return {"records": records, "requests": requests, "status_before": st0, "status_after": st1}


def replay_runtime(files, requests_by_file, settings) -> dict:
    """The same requests, at the same moments, straight to the runtime: no cache, no cancellation."""
    from ..lsp_server.completion import SAMPLING
    from ..lsp_server.documents import Document
    from ..lsp_server.postprocess import finish
    from ..lsp_server.prompt import PromptBuilder
    from ..runtime import PRIORITY_INTERACTIVE, get_runtime

    rt = get_runtime()
    spec = rt.spec(None)
    m = rt.load(spec)
    b = PromptBuilder(m)
    decoded0 = m.stats["decoded_tokens"]
    records: list[dict] = []
    threads = []
    for name, reqs in requests_by_file:
        anchor = None
        t_origin = time.perf_counter()
        first_t = reqs[0][0] if reqs else 0.0
        for t, text, offset, multi, next_key in reqs:
            delay = (t - first_t) - (time.perf_counter() - t_origin)
            if delay > 0:
                time.sleep(delay)
            doc = Document(f"file:///bench/{name}.py", text, 0, "python")
            cur = doc.cursor(position(text, offset), "utf-16")
            p = b.build(cur, anchor=anchor, context_block="", budget=settings.context_tokens,
                        suffix_tokens=0, use_fim=False)
            anchor = p.anchor
            t0 = time.perf_counter()
            stream = rt.submit(p.sent, model=spec,
                               max_tokens=settings.max_tokens if multi else settings.max_tokens_single_line,
                               sampling=SAMPLING, stop=["\n\n\n"] if multi else ["\n"],
                               priority=PRIORITY_INTERACTIVE)
            # the typist's next keystroke makes the answer stale
            rec = {"multiline": multi, "file": name, "deadline": next_key - first_t, "sent": t - first_t}
            records.append(rec)

            def wait(stream=stream, rec=rec, t0=t0, cur=cur, multi=multi, t_origin=t_origin):
                res = stream.result()
                rec["latency_ms"] = (time.perf_counter() - t0) * 1000
                rec["arrived"] = time.perf_counter() - t_origin
                rec["decoded"] = res.n_prompt_tokens - res.n_cached_prompt_tokens + res.n_tokens
                rec["suggestion"] = bool(finish(res.text, cur, multi))

            th = threading.Thread(target=wait)
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
    decoded = m.stats["decoded_tokens"] - decoded0
    # a suggestion that arrives after the typist's next keystroke is never seen
    useful = sum(r["decoded"] for r in records if r["arrived"] <= r["deadline"])
    return {"records": records, "decoded_tokens": decoded, "useful_decode_tokens": useful}


def isolated_runtime(requests_by_file, settings) -> list[dict]:
    """Each request alone, one after the other: the model's own cost of a request, without cache."""
    from ..lsp_server.completion import SAMPLING
    from ..lsp_server.documents import Document
    from ..lsp_server.prompt import PromptBuilder
    from ..runtime import PRIORITY_INTERACTIVE, get_runtime

    rt = get_runtime()
    spec = rt.spec(None)
    b = PromptBuilder(rt.load(spec))
    out = []
    for name, reqs in requests_by_file:
        anchor = None
        for _t, text, offset, multi, _ in reqs:
            cur = Document(f"file:///bench/{name}.py", text, 0, "python").cursor(position(text, offset), "utf-16")
            p = b.build(cur, anchor=anchor, context_block="", budget=settings.context_tokens, suffix_tokens=0,
                        use_fim=False)
            anchor = p.anchor
            t0 = time.perf_counter()
            rt.generate(p.sent, model=spec, priority=PRIORITY_INTERACTIVE,
                        max_tokens=settings.max_tokens if multi else settings.max_tokens_single_line,
                        sampling=SAMPLING, stop=["\n\n\n"] if multi else ["\n"])
            out.append({"multiline": multi, "latency_ms": (time.perf_counter() - t0) * 1000})
    return out


def summarize(latencies: list[float]) -> dict:
    return {"n": len(latencies), "p50": percentile(latencies, 0.5), "p95": percentile(latencies, 0.95),
            "p99": percentile(latencies, 0.99)}


def server_figures(srv: dict) -> dict:
    """The language server's replay: latencies, its cache and the tokens it decoded in vain."""
    recs = srv["records"]
    answered = [r for r in recs if "latency_ms" in r and not r.get("cancelled")]
    c0 = srv["status_before"]["server"]["counters"]
    c1 = srv["status_after"]["server"]["counters"]
    m0 = srv["status_before"]["runtime"]["models"][0]["stats"] if srv["status_before"]["runtime"]["models"] else {}
    m1 = srv["status_after"]["runtime"]["models"][0]["stats"]
    decoded = m1.get("decoded_tokens", 0) - m0.get("decoded_tokens", 0)
    useful = c1.get("useful_decode_tokens", 0) - c0.get("useful_decode_tokens", 0)
    cache = srv["status_after"]["server"]["cache"]
    hits = cache["hits_exact"] + cache["hits_typed_ahead"]
    return {
        "requests": len(recs), "answered": len(answered), "cancelled_by_client": len(recs) - len(answered),
        "with_suggestion": sum(1 for r in answered if r.get("suggestion")),
        **latencies(answered),
        "cache_hit_rate": hits / max(1, hits + cache["misses"]), "cache": cache,
        "decoded_tokens": decoded, "wasted_decode_fraction": 1 - useful / decoded if decoded else 0.0,
        "counters": {k: c1.get(k, 0) - c0.get(k, 0) for k in c1},
    }


def latencies(records: list[dict]) -> dict:
    return {"single_line": summarize([r["latency_ms"] for r in records if not r["multiline"]]),
            "multi_line": summarize([r["latency_ms"] for r in records if r["multiline"]]),
            "all": summarize([r["latency_ms"] for r in records])}


def single_line(records: list[dict]) -> list[float]:
    return sorted(r["latency_ms"] for r in records if not r["multiline"])


def report(res: dict, curves: dict[str, list[float]]) -> None:
    """The table, the ratios to the server and the plot of single-line latencies (`curves`, by row)."""
    server, baseline, isolated = res["server"], res["baseline"], res["isolated"]

    def row(name, d):
        s, m = d["single_line"], d["multi_line"]
        return [name, d["requests"], d.get("answered", d["requests"]), s["n"], s["p50"], s["p95"], s["p99"],
                m["n"], m["p50"], m["p95"],
                f"{100 * d['cache_hit_rate']:.0f}%", d["decoded_tokens"] if d["decoded_tokens"] is not None else "-",
                f"{100 * d['wasted_decode_fraction']:.0f}%" if d["wasted_decode_fraction"] is not None else "-"]

    print_table("Inline completion while typing (latency in ms, answered requests)",
                ["", "requests", "answered", "1-line n", "p50", "p95", "p99", "multi n", "p50", "p95", "cache hits",
                 "decoded tok", "wasted"],
                [row("language server", server), row("runtime, no cache", baseline),
                 row("runtime, one at a time", isolated)])
    ratio, ratio_alone = res["single_line_ratio_baseline_over_server"], res["single_line_ratio_isolated_over_server"]
    print(f"single-line latency, runtime without cache at the same moments / server: p50 {ratio['p50']:.2f}x, "
          f"p95 {ratio['p95']:.2f}x, p99 {ratio['p99']:.2f}x; "
          f"decoded tokens {baseline['decoded_tokens'] / max(1, server['decoded_tokens']):.2f}x")
    print(f"single-line latency, runtime one request at a time / server: p50 {ratio_alone['p50']:.2f}x, "
          f"p95 {ratio_alone['p95']:.2f}x, p99 {ratio_alone['p99']:.2f}x")

    def draw(ax):
        for (name, xs), style in zip(curves.items(), ("-", "--", ":")):
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], style, label=name)
        ax.axvline(150, color="grey", lw=0.8, ls=":")
        ax.axvline(400, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("single-line completion latency (ms, log)")
        ax.set_ylabel("fraction of answered requests")
        ax.set_title("Typing replay, embedded SmolLM2-135M, 2 CPU cores")
        ax.legend()

    plot("lsp", draw)


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--files", default="textwrap,shlex,fnmatch", help="standard-library modules to type")
    ap.add_argument("--chars", type=int, default=260, help="characters typed per file")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    from ..lsp_server.config import Settings

    files = [(mod, *pick_region(mod, args.chars)) for mod in args.files.split(",")]
    server_cmd = [sys.executable, "-m", "comfyui_a3b.cli", "lsp", "--stdio"]
    print(f"typing {sum(len(f[2]) for f in files)} characters of {', '.join(f[0] + '.py' for f in files)}; "
          f"client debounce {DEBOUNCE_S * 1000:.0f} ms", flush=True)
    srv = asyncio.run(replay_server(files, args.seed, server_cmd))
    by_file: dict[str, list] = {}
    for req, rec in zip(srv["requests"], srv["records"]):
        by_file.setdefault(rec["file"], []).append(req)
    base = replay_runtime(files, list(by_file.items()), Settings())
    alone = isolated_runtime(list(by_file.items()), Settings())

    server = server_figures(srv)
    brecs = base["records"]
    baseline = {
        "requests": len(brecs), **latencies(brecs), "cache_hit_rate": 0.0, "decoded_tokens": base["decoded_tokens"],
        "wasted_decode_fraction": (1 - base["useful_decode_tokens"] / base["decoded_tokens"]
                                   if base["decoded_tokens"] else 0.0),
        "late_answers": sum(1 for r in brecs if r["arrived"] > r["deadline"]),
    }
    isolated = {"requests": len(alone), **latencies(alone), "cache_hit_rate": 0.0, "decoded_tokens": None,
                "wasted_decode_fraction": None}

    def ratios(ref):
        return {k: (ref["single_line"][k] / server["single_line"][k]) if server["single_line"][k] else None
                for k in ("p50", "p95", "p99")}

    res = {"files": [f[0] for f in files], "chars": args.chars, "seed": args.seed,
           "client_debounce_ms": DEBOUNCE_S * 1000, "server": server, "baseline": baseline,
           "isolated": isolated, "single_line_ratio_baseline_over_server": ratios(baseline),
           "single_line_ratio_isolated_over_server": ratios(isolated),
           "command": "python -m comfyui_a3b.bench.bench_lsp " + " ".join(argv or sys.argv[1:])}
    answered = [r for r in srv["records"] if "latency_ms" in r and not r.get("cancelled")]
    curves = {"language server": single_line(answered), "runtime, no cache": single_line(brecs),
              "runtime, one at a time": single_line(alone)}
    write_results("lsp", res)
    report(res, curves)
    return 0


if __name__ == "__main__":
    sys.exit(main())
