"""The language server when its editor misbehaves or dies, over the fake engine (fast tier): a dead
client while context indexing runs or with many messages still queued, completions beside indexing
of many open files, warming.

The fake model reads slowly on purpose (see the model URLs below), so background work is still
running when the interesting thing happens.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import pytest

from lsp_helpers import FAKE_MODEL, FAKE_SERVER, SAMPLE, RawClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: decodes take 4 ms a token; each embedding pack of 8 chunks 150 ms: indexing 30 files takes seconds
SLOW_INDEXING = "fake://indexing?text=(text.split())%0A&delay_ms=4&embed_delay_ms=150"


def source_file(i: int) -> str:
    """A distinct file of about 60 lines, enough for several context chunks."""
    return "\n\n".join(f"def helper_{i}_{k}(values):\n    total = 0\n    for v in values:\n        total += v * {k}\n"
                       f"    return total\n" for k in range(12))


async def open_files(raw: RawClient, n: int) -> None:
    for i in range(n):
        raw.notify("textDocument/didOpen", {"textDocument": {"uri": f"file:///w/f{i}.py", "languageId": "python",
                                                             "version": 1, "text": source_file(i)}})


def completion(raw: RawClient, id_: int, line: int = 12, character: int = 14) -> None:
    raw.request(id_, "textDocument/inlineCompletion", {"textDocument": {"uri": "file:///w/main.py"},
                                                       "position": {"line": line, "character": character},
                                                       "context": {"triggerKind": 1}})


async def status(raw: RawClient, id_: int) -> dict:
    raw.request(id_, "workspace/executeCommand", {"command": "a3b.status"})
    return (await raw.response(id_))["result"]


async def test_the_stdio_server_exits_within_5_s_of_losing_its_editor_mid_indexing(fake_engine):
    raw = await RawClient.stdio("--model", SLOW_INDEXING, server=FAKE_SERVER)
    await raw.initialize(options={"debounceMs": 0})
    await open_files(raw, 30)
    raw.notify("textDocument/didOpen", {"textDocument": {"uri": "file:///w/main.py", "languageId": "python",
                                                         "version": 1, "text": SAMPLE}})
    completion(raw, 1)                        # a new window: context selection starts indexing
    await raw.response(1)
    st = await status(raw, 2)
    assert st["server"]["embedded_chunks"] < 200, "indexing finished too early for this test to mean anything"
    t0 = time.monotonic()
    raw.writer.close()                        # the editor died: stdin closes
    await asyncio.wait_for(raw.proc.wait(), 10)
    assert time.monotonic() - t0 < 5.0


async def test_completions_do_not_wait_for_indexing_of_many_open_files(fake_engine):
    async def latencies(n_files: int) -> list[float]:
        raw = await RawClient.stdio("--model", SLOW_INDEXING, server=FAKE_SERVER)
        try:
            await raw.initialize(options={"debounceMs": 0})
            await open_files(raw, n_files)
            raw.notify("textDocument/didOpen", {"textDocument": {"uri": "file:///w/main.py", "languageId": "python",
                                                                 "version": 1, "text": SAMPLE}})
            await status(raw, 1)                  # the model is loaded
            out = []
            last = SAMPLE.count("\n")
            for k in range(6):                    # a new line each time: no cache hits, new windows
                raw.notify("textDocument/didChange", {
                    "textDocument": {"uri": "file:///w/main.py", "version": 2 + k},
                    "contentChanges": [{"range": {"start": {"line": last + k, "character": 0},
                                                  "end": {"line": last + k, "character": 0}},
                                        "text": f"x{k} = len\n"}]})
                t0 = time.perf_counter()
                completion(raw, 10 + k, line=last + k, character=6)
                res = await raw.response(10 + k)
                assert "result" in res, res
                out.append(time.perf_counter() - t0)
            st = await status(raw, 99)
            if n_files:
                assert st["server"]["embedded_chunks"] < 256, "indexing was over before the completions"
            return out
        finally:
            raw.request(100, "shutdown")
            raw.notify("exit")
            await raw.close()

    alone = await latencies(0)
    busy = await latencies(30)
    p95 = lambda xs: sorted(xs)[int(0.95 * (len(xs) - 1))]  # noqa: E731
    # an interactive request waits at most one embedding pack (150 ms here) behind the indexing
    assert p95(busy) < 2 * p95(alone) + 0.3, (alone, busy)


async def test_an_edit_then_a_pause_warms_the_next_completions_prompt(fake_engine):
    raw = await RawClient.stdio("--model", "fake://warm?text=(x)%0A&delay_ms=2", server=FAKE_SERVER)
    try:
        await raw.initialize(options={"debounceMs": 0})
        raw.notify("textDocument/didOpen", {"textDocument": {"uri": "file:///w/main.py", "languageId": "python",
                                                             "version": 1, "text": SAMPLE}})
        await status(raw, 1)
        raw.notify("textDocument/didChange", {"textDocument": {"uri": "file:///w/main.py", "version": 2},
                                              "contentChanges": [{"range": {"start": {"line": 12, "character": 14},
                                                                            "end": {"line": 12, "character": 14}},
                                                                  "text": "("}]})
        deadline = time.monotonic() + 10
        while (await status(raw, 2))["server"]["counters"].get("warmed_tokens", 0) == 0:
            assert time.monotonic() < deadline, "no prompt was warmed after the pause"
            await asyncio.sleep(0.05)
        completion(raw, 3, line=12, character=15)
        assert "result" in await raw.response(3)
        c = (await status(raw, 4))["server"]["counters"]
        assert c["prefill_tokens"] <= 2 and c["cached_prompt_tokens"] > 100   # only the last token was new
        # a3b/cursor from the editor does the same without an edit; junk is ignored
        raw.notify("a3b/cursor", {"textDocument": {"uri": "file:///w/main.py"},
                                  "position": {"line": 20, "character": 0}})
        raw.notify("a3b/cursor", {"nonsense": True})
        raw.notify("a3b/cursor", {"textDocument": {"uri": "file:///w/other.py"},
                                  "position": {"line": 999, "character": 0}})
        deadline = time.monotonic() + 10
        while (await status(raw, 5))["server"]["counters"]["warmed_tokens"] == c["warmed_tokens"]:
            assert time.monotonic() < deadline, "a3b/cursor warmed nothing"
            await asyncio.sleep(0.05)
    finally:
        raw.request(100, "shutdown")
        raw.notify("exit")
        await raw.close()


def _frame(msg: dict) -> bytes:
    body = json.dumps(msg).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def _edit(uri: str, version: int, line: int, character: int, text: str) -> dict:
    return {"jsonrpc": "2.0", "method": "textDocument/didChange", "params": {
        "textDocument": {"uri": uri, "version": version},
        "contentChanges": [{"range": {"start": {"line": line, "character": character},
                                      "end": {"line": line, "character": character}}, "text": text}]}}


async def _seconds_to_exit_after_stdin_closes(messages: bytes) -> float:
    """Start a server, initialize it, write `messages` at once and close stdin: the seconds from
    the close to the process's exit. What the server answers is read (and dropped) meanwhile, as
    an editor's pipe would take it."""
    raw = await RawClient.stdio("--model", FAKE_MODEL, server=FAKE_SERVER)

    async def drain_stdout():
        while await raw.reader.read(1 << 16):
            pass

    try:
        await raw.initialize(options={"debounceMs": 0})
        reading = asyncio.ensure_future(drain_stdout())
        raw.writer.write(messages)
        await raw.writer.drain()
        t0 = time.monotonic()
        raw.writer.close()
        await asyncio.wait_for(raw.proc.wait(), 60)
        took = time.monotonic() - t0
        await reading
        return took
    finally:
        if raw.proc.returncode is None:
            raw.proc.kill()
            await raw.proc.wait()


async def test_stdin_closing_with_edits_of_a_20_mb_document_queued_exits_within_5_s(fake_engine):
    uri = "file:///w/big.py"
    line = "x = 1  # " + "a" * 20_000_000
    out = [_frame({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
        "uri": uri, "languageId": "python", "version": 1, "text": line + "\n"}}})]
    out += [_frame(_edit(uri, 2 + k, 0, len(line) - 10 + k, "b")) for k in range(200)]
    assert await _seconds_to_exit_after_stdin_closes(b"".join(out)) < 5.0


async def test_stdin_closing_exits_within_5_s_whatever_is_queued(fake_engine):
    uri = "file:///w/small.py"
    out = [_frame({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
        "uri": uri, "languageId": "python", "version": 1, "text": SAMPLE}}})]
    # edits of 5000 changes each: reading them is quick, applying them all takes far longer than 5 s
    change = _edit(uri, 0, 3, 0, "#")["params"]["contentChanges"][0]
    for k in range(80):
        msg = _edit(uri, 2 + k, 3, 0, "#")
        msg["params"]["contentChanges"] = [change] * 5000
        out.append(_frame(msg))
    assert await _seconds_to_exit_after_stdin_closes(b"".join(out)) < 5.0


async def _messages_until(raw: RawClient, id_) -> tuple[list[dict], dict]:
    """Everything the server sends up to the response to `id_`: (the other messages, that response)."""
    seen = []
    while True:
        msg = await raw.recv(30)
        assert msg is not None, "the server closed the connection"
        if msg.get("id") == id_ and "method" not in msg:
            return seen, msg
        seen.append(msg)


def _popups(msgs: list[dict]) -> list[str]:
    return [m["params"]["message"] for m in msgs if m.get("method") == "window/showMessage"]


def _times(popup: str) -> int:
    """How many refusals one message tells of ("A3B ... 400 times; the first time: ..." or one)."""
    m = re.match(r"A3B [^:]*? (\d+) times; the first time: ", popup)
    return int(m.group(1)) if m else 1


async def _refusals_told(raw: RawClient, n: int, next_id: int) -> list[str]:
    """The messages that tell the user of `n` refusals, and any that come a while after them.
    A server on a loaded machine may take over a second to read a burst: it may then tell of it in
    two messages (one per second at most), never in one per refusal."""
    popups: list[str] = []
    while sum(map(_times, popups)) < n:
        msg = await raw.recv(30)
        assert msg is not None, "the server closed the connection"
        popups += _popups([msg])
    await asyncio.sleep(2.0)
    raw.request(next_id, "workspace/executeCommand", {"command": "a3b.status"})
    more, _ = await _messages_until(raw, next_id)
    return popups + _popups(more)


@contextlib.asynccontextmanager
async def _server_with(uri: str, text: str):
    """A fresh server over the fake engine, initialized, with one document open."""
    raw = await RawClient.stdio("--model", FAKE_MODEL, server=FAKE_SERVER)
    try:
        await raw.initialize(options={"debounceMs": 0})
        raw.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1,
                                                             "text": text}})
        yield raw
    finally:
        raw.proc.kill()
        await raw.proc.wait()


async def test_an_edit_whose_text_is_not_a_string_is_refused_and_said_once(fake_engine):
    uri = "file:///w/a.py"
    async with _server_with(uri, "abc\n") as raw:
        for k in range(200):
            raw.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": 2 + k},
                                                  "contentChanges": [{"text": 5}]})
        raw.request(1, "workspace/executeCommand", {"command": "a3b.status", "arguments": [uri]})
        seen, res = await _messages_until(raw, 1)
        assert res["result"]["document"]["length"] == 4        # the document is what it was
        popups = _popups(seen) + await _refusals_told(raw, 200 - sum(map(_times, _popups(seen))), 2)
        assert sum(map(_times, popups)) == 200 and len(popups) <= 3, popups
        assert "malformed textDocument/didChange" in popups[0] and "expected str" in popups[0], popups


async def test_400_edits_that_cannot_be_applied_make_one_message_with_a_count(fake_engine):
    uri = "file:///w/a.py"
    async with _server_with(uri, "abc\n") as raw:
        for k in range(400):   # line 50 is far outside a document of two lines
            raw.send(_edit(uri, 2 + k, 50, 0, "x"))
        popups = await _refusals_told(raw, 400, 1)
        assert sum(map(_times, popups)) == 400 and len(popups) <= 3, popups
        assert popups[0].startswith("A3B could not apply an edit") and "outside the document" in popups[0], popups
        assert popups[0].endswith("Close and reopen the file."), popups


async def test_expected_client_errors_and_cancels_are_logged_without_tracebacks(fake_engine):
    proc = await asyncio.create_subprocess_exec(*FAKE_SERVER, "--model", FAKE_MODEL, "--stdio",
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, limit=1 << 26)
    raw = RawClient(proc.stdout, proc.stdin, proc)
    try:
        await raw.initialize(options={"debounceMs": 0})
        completion(raw, 1)                       # main.py was never opened
        res = await raw.response(1)
        assert res["error"]["code"] == -32602 and "is not open" in res["error"]["message"]
        raw.notify("textDocument/didChange", {"textDocument": {"uri": "file:///w/x.py", "version": 2},
                                              "contentChanges": [{"text": 5}]})     # malformed, too
        uri = "file:///w/explain.py"
        raw.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1,
                                                             "text": SAMPLE}})
        raw.request(3, "workspace/executeCommand", {"command": "a3b.explainSelection", "arguments": [
            uri, {"start": {"line": 0, "character": 0}, "end": {"line": 22, "character": 0}}]})
        await asyncio.sleep(0.5)                 # the explanation is being written (8 ms a token)
        raw.notify("$/cancelRequest", {"id": 3})
        assert (await raw.response(3))["error"]["code"] == -32800
        await asyncio.sleep(0.5)                 # the generation ends with Cancelled meanwhile
        raw.request(2, "shutdown")
        await raw.response(2)
        raw.notify("exit")
        err = (await asyncio.wait_for(proc.stderr.read(), 30)).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    assert "Traceback" not in err and "never retrieved" not in err, err
    lines = [ln for ln in err.splitlines() if "is not open" in ln]
    assert len(lines) == 1, err
    assert len([ln for ln in err.splitlines() if "didChange" in ln]) == 1, err


async def test_an_invalid_answer_to_apply_edit_ends_the_command_with_an_error(fake_engine):
    uri = "file:///w/fix.py"
    async with _server_with(uri, "def f(x):\n    return len(x\n") as raw:
        data = {"kind": "diagnostic", "uri": uri, "line": 1, "end_line": 1, "message": "'(' was never closed"}
        for k, answer in enumerate((42, {"applied": "yes"})):
            raw.request(10 + k, "workspace/executeCommand", {"command": "a3b.fix", "arguments": [data]})
            while True:      # the server asks the editor to apply the fix; the editor answers nonsense
                msg = await raw.recv(30)
                assert msg is not None and msg.get("id") != 10 + k, msg
                if msg.get("method") == "workspace/applyEdit":
                    # a malformed reply bearing the id of the editor's own request changes nothing
                    raw.send({"jsonrpc": "2.0", "id": 10 + k, "error": "bad"})
                    raw.send({"jsonrpc": "2.0", "id": msg["id"], "result": answer})
                    break
            res = await raw.response(10 + k, timeout=10)
            assert "not valid" in res["error"]["message"], res
