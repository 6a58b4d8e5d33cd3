"""The language server end to end over stdio: a real pytest-lsp client and a real server process.
Bad inputs each get their clear error.

Every test runs twice: with the server over the fake engine (fast tier; the model writes a known
line, see fakeengine.py) and over the embedded model (`slow`). Tests of what only a real model shows
(a multi-line block that stays in its indentation) run on the embedded model only."""
from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
import pytest_asyncio
from lsprotocol import types as T
from pygls.exceptions import JsonRpcException
from pytest_lsp import ClientServerConfig, LanguageClient, client_capabilities

from lsp_helpers import (MULTI, SAMPLE, SINGLE, RawClient, Server, configure, counters, inline, inline_params,
                         insert, model_stats, open_doc, real_only, status)

pytestmark = pytest.mark.asyncio(loop_scope="module")

@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(srv: Server):
    c = await ClientServerConfig(server_command=srv.command + ["--stdio"]).start(devtools=None)
    await c.initialize_session(T.InitializeParams(
        capabilities=client_capabilities("visual-studio-code"),
        initialization_options={"a3b": {"debounceMs": 0}}))
    yield c
    await c.shutdown_session()
    await c.stop()


async def test_model_loading_is_reported_as_progress(client: LanguageClient, srv: Server):
    st = await status(client)
    assert st["model"] == srv.model_name
    for _ in range(100):
        reports = [p for reps in client.progress_reports.values() for p in reps]
        if any(getattr(p, "kind", None) == "end" for p in reports):
            break
        await asyncio.sleep(0.05)
    kinds = [getattr(p, "kind", None) for p in reports]
    assert kinds[:1] == ["begin"] and "end" in kinds
    assert f"loading {srv.model_name[:8]}" in reports[0].message


async def test_capabilities_on_a_fresh_connection(srv: Server):
    raw = await RawClient.stdio(server=srv.command)
    try:
        res = await raw.initialize()
        caps = res["result"]["capabilities"]
        assert caps["inlineCompletionProvider"] == {}        # InlineCompletionOptions
        assert caps["completionProvider"] is not None
        assert caps["codeActionProvider"]["resolveProvider"] is True
        assert set(caps["executeCommandProvider"]["commands"]) >= {"a3b.status", "a3b.explainSelection",
                                                                   "a3b.fixTraceback"}
        assert caps["textDocumentSync"]["change"] == 2           # incremental
        raw.request(1, "shutdown")
        await raw.response(1)
        raw.notify("exit")
    finally:
        await raw.close()
    assert raw.proc.returncode == 0


async def test_inline_completion_then_exact_and_typed_ahead_cache_hits(client: LanguageClient):
    uri = "file:///w/cache_demo.py"
    open_doc(client, uri, SAMPLE)
    first = await inline(client, uri, SINGLE)
    assert len(first) == 1 and first[0].strip(), first
    before = counters(await status(client))
    again = await inline(client, uri, SINGLE)
    assert again == first
    after = counters(await status(client))
    assert after.get("answered_cache_exact", 0) == before.get("answered_cache_exact", 0) + 1
    assert after.get("generations", 0) == before.get("generations", 0)  # no model run
    # the user types the first character of the suggestion: the rest comes from the cache
    typed = first[0][0]
    insert(client, uri, 2, SINGLE, typed)
    rest = await inline(client, uri, T.Position(SINGLE.line, SINGLE.character + 1))
    assert rest == [first[0][1:]]
    assert counters(await status(client)).get("answered_cache_typed", 0) >= 1


async def test_completion_for_clients_without_inline_completion(client: LanguageClient):
    uri = "file:///w/completion_demo.py"
    open_doc(client, uri, SAMPLE)
    res = await client.text_document_completion_async(T.CompletionParams(
        text_document=T.TextDocumentIdentifier(uri), position=SINGLE))
    assert res.is_incomplete is True and len(res.items) == 1
    item = res.items[0]
    edit = item.text_edit
    # the edit replaces the word being typed ("len") with the word plus the suggestion
    assert edit.range.start == T.Position(SINGLE.line, SINGLE.character - 3) and edit.range.end == SINGLE
    assert edit.new_text.startswith("len") and len(edit.new_text) > 3


async def test_multi_line_suggestion_stays_in_its_block(client: LanguageClient, srv: Server):
    real_only(srv)
    uri = "file:///w/multi_demo.py"
    open_doc(client, uri, SAMPLE)
    [text] = await inline(client, uri, MULTI) or [""]
    lines = text.split("\n")
    assert text.startswith("\n") and len(lines) >= 2
    assert all(ln.startswith("        ") for ln in lines[1:] if ln.strip())  # indented under the with
    assert "return f.read().splitlines()" not in text  # never repeats the code below the cursor


async def test_chunks_of_other_open_files_join_the_prompt_in_the_background(client: LanguageClient):
    helper = "file:///w/wordstats.py"
    open_doc(client, helper, "def word_lengths(text):\n    return [len(w) for w in text.split()]\n\n\n"
                             "def longest_word(text):\n    return max(text.split(), key=len)\n")
    uri = "file:///w/context_demo.py"
    open_doc(client, uri, SAMPLE)
    await inline(client, uri, SINGLE)        # the first window of this file: chunks are chosen now
    deadline = time.monotonic() + 120  # embedding the chunks runs at batch priority: slow on a busy machine
    while True:
        st = await status(client)
        if uri in st["context_files"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert uri in st["context_files"], "no context chunks were chosen within 120 s"
    chosen = st["context_files"][uri]
    assert chosen and uri not in chosen and all(f.startswith("file:///w/") for f in chosen)
    assert counters(st).get("prewarm_tokens", 0) > 0     # the new prompt was prefilled at batch priority
    gens = counters(st)["generations"]
    assert await inline(client, uri, MULTI) is not None
    assert counters(await status(client))["generations"] == gens + 1


async def test_latest_request_wins_and_the_old_generation_stops(client: LanguageClient):
    await configure(client, maxTokens=256)
    try:
        uri = "file:///w/latest_demo.py"
        open_doc(client, uri, SAMPLE + "\n\nclass Report:\n")
        before = await status(client)
        old = asyncio.ensure_future(client.text_document_inline_completion_async(
            inline_params(uri, T.Position(25, 0))))     # an empty line after a class: a long multi-line run
        for _ in range(2000):   # until the old request's generation has produced text
            g = (await status(client))["generating"]
            if g and g["uri"] == uri and g["chars"] > 0:
                break
            await asyncio.sleep(0.005)
        assert g and g["chars"] > 0
        t0 = time.perf_counter()
        new = await inline(client, uri, SINGLE)
        old_items = (await old).items
        assert len(old_items) == 0  # superseded: answered empty, not after a full run
        assert new and new[0]
        after = await status(client)
        c0, c1 = counters(before), counters(after)
        assert c1.get("cancelled_superseded", 0) > c0.get("cancelled_superseded", 0)
        assert c1.get("generations_cancelled", 0) > c0.get("generations_cancelled", 0)
        # the cancelled run stopped early: far fewer tokens than its 256-token budget
        wasted = c1.get("wasted_generated_tokens", 0) - c0.get("wasted_generated_tokens", 0)
        assert wasted < 200, wasted
        assert time.perf_counter() - t0 < 120
    finally:
        await configure(client, maxTokens=64)


async def test_cancel_request_stops_the_generation_between_tokens(client: LanguageClient):
    uri = "file:///w/cancel_demo.py"
    open_doc(client, uri, SAMPLE)
    st0 = await status(client)
    # explaining the whole sample takes the embedded model about 155 tokens
    fut = asyncio.ensure_future(client.protocol.send_request_async("workspace/executeCommand", T.ExecuteCommandParams(
        command="a3b.explainSelection",
        arguments=[uri, {"start": {"line": 0, "character": 0}, "end": {"line": 22, "character": 0}}]),
        msg_id="explain-1"))
    await asyncio.sleep(1.0)
    client.cancel_request(T.CancelParams(id="explain-1"))
    with pytest.raises(JsonRpcException) as e:
        await fut
    assert e.value.code == -32800  # RequestCancelled
    for _ in range(100):
        st1 = await status(client)
        if model_stats(st1).get("finished_cancelled", 0) > model_stats(st0).get("finished_cancelled", 0):
            break
        await asyncio.sleep(0.1)
    assert model_stats(st1)["finished_cancelled"] == model_stats(st0).get("finished_cancelled", 0) + 1
    assert model_stats(st1)["generated_tokens"] - model_stats(st0)["generated_tokens"] < 150


async def test_code_action_title_is_cheap_and_resolve_returns_an_edit(client: LanguageClient):
    uri = "file:///w/fix_demo.py"
    text = "def mean(xs):\n    return sum(xs) / len(xs\n\nprint(mean([1, 2]))\n"
    open_doc(client, uri, text)
    diag = T.Diagnostic(range=T.Range(T.Position(1, 4), T.Position(1, 28)), message="'(' was never closed",
                        severity=T.DiagnosticSeverity.Error, source="pyflakes")
    before = model_stats(await status(client))
    actions = await client.text_document_code_action_async(T.CodeActionParams(
        text_document=T.TextDocumentIdentifier(uri), range=diag.range,
        context=T.CodeActionContext(diagnostics=[diag])))
    fix = next(a for a in actions if a.title.startswith("Fix with A3B"))
    assert "never closed" in fix.title and fix.edit is None and fix.kind == T.CodeActionKind.QuickFix
    assert model_stats(await status(client)).get("submitted", 0) == before.get("submitted", 0)  # no model yet
    resolved = await client.code_action_resolve_async(fix)
    edits = resolved.edit.changes[uri]
    assert len(edits) == 1 and edits[0].new_text.strip()
    assert edits[0].range.start.line <= 1 <= edits[0].range.end.line


async def test_pasted_traceback_offers_a_fix_in_the_file_it_names(client: LanguageClient):
    lib = "file:///w/lib_demo.py"
    open_doc(client, lib, "def ratio(a, b):\n    return a / b\n")
    notes = "file:///w/notes.txt"
    tb = ('Traceback (most recent call last):\n  File "/w/app.py", line 3, in <module>\n    ratio(1, 0)\n'
          '  File "/w/lib_demo.py", line 2, in ratio\n    return a / b\nZeroDivisionError: division by zero\n')
    open_doc(client, notes, tb, language="plaintext")
    actions = await client.text_document_code_action_async(T.CodeActionParams(
        text_document=T.TextDocumentIdentifier(notes), range=T.Range(T.Position(0, 0), T.Position(6, 0)),
        context=T.CodeActionContext(diagnostics=[])))
    act = next(a for a in actions if a.title == "Fix traceback with A3B")
    resolved = await client.code_action_resolve_async(act)
    assert list(resolved.edit.changes) == [lib]   # the fix edits the file the traceback names
    assert any(a.title == "Explain with A3B" for a in actions)


async def test_explain_selection_and_status(client: LanguageClient):
    uri = "file:///w/explain_demo.py"
    open_doc(client, uri, SAMPLE)
    res = await client.workspace_execute_command_async(T.ExecuteCommandParams(
        command="a3b.explainSelection",
        arguments=[uri, {"start": {"line": 10, "character": 0}, "end": {"line": 13, "character": 0}}]))
    assert res["explanation"] and res["tokens"] > 0
    st = await status(client)
    srv = st["server"]
    assert st["runtime"]["weight_loads"] >= 1 and st["runtime"]["memory_bytes"] > 0
    assert 0.0 <= srv["cache"]["hit_rate"] <= 1.0 and srv["latency_ms_all"]["p50"] is not None


async def test_low_confidence_spans_become_information_diagnostics(client: LanguageClient):
    uri = "file:///w/spans_demo.py"
    open_doc(client, uri, "x = 1\n")
    inserted = "y = compute_something(x)\n"
    insert(client, uri, 2, T.Position(1, 0), inserted)
    # what an editor runs when the user accepts a completion that carried low-confidence spans
    await client.workspace_execute_command_async(T.ExecuteCommandParams(
        command="a3b.completionAccepted", arguments=[uri, 6, inserted, [[4, 21, 2.7]]]))
    for _ in range(50):
        if client.diagnostics.get(uri):
            break
        await asyncio.sleep(0.05)
    [d] = client.diagnostics[uri]
    assert d.severity == T.DiagnosticSeverity.Information and d.source == "a3b"
    assert d.range == T.Range(T.Position(1, 4), T.Position(1, 21))
    # editing the span away clears the diagnostic
    client.text_document_did_change(T.DidChangeTextDocumentParams(
        text_document=T.VersionedTextDocumentIdentifier(uri=uri, version=3),
        content_changes=[T.TextDocumentContentChangePartial(range=T.Range(T.Position(1, 0), T.Position(2, 0)),
                                                            text="")]))
    for _ in range(50):
        if not client.diagnostics.get(uri):
            break
        await asyncio.sleep(0.05)
    assert len(client.diagnostics[uri]) == 0


async def test_configuration_changes_and_bad_values(client: LanguageClient, srv: Server):
    n = len(client.messages)
    await configure(client, debounceMs=5, maxTokens="lots", contextChunks=99, nope=1)
    st = await status(client)
    assert st["settings"]["debounce_ms"] == 5 and st["settings"]["max_tokens"] == 64
    msgs = [m.message for m in client.messages[n:]]
    assert any("'maxTokens' must be an integer" in m for m in msgs)
    assert any("'contextChunks' must be an integer in 0..16" in m for m in msgs)
    assert any("Unknown A3B setting 'nope'" in m for m in msgs)
    await configure(client, model="/etc/passwd")
    msgs = [m.message for m in client.messages[n:]]
    assert any("model setting rejected" in m and "outside the allowed model folders" in m for m in msgs)
    assert (await status(client))["model"] == srv.model_name
    await configure(client, model=None, debounceMs=0)


# -- bad input ----------------------------------------------------------------------------------
async def test_position_outside_the_document_is_an_invalid_params_error(client: LanguageClient):
    uri = "file:///w/short.py"
    open_doc(client, uri, "x = 1\n")
    with pytest.raises(JsonRpcException) as e:
        await inline(client, uri, T.Position(500, 0))
    assert e.value.code == -32602 and "outside the document" in e.value.message and "2 lines" in e.value.message
    with pytest.raises(JsonRpcException) as e:
        await inline(client, "file:///w/never_opened.py", T.Position(0, 0))
    assert "not open" in e.value.message


async def test_binary_content_is_refused_clearly(client: LanguageClient):
    uri = "file:///w/blob.bin"
    open_doc(client, uri, "\x7fELF\x02\x01\x01\x00\x00\x00garbage\x00\x00")
    with pytest.raises(JsonRpcException) as e:
        await inline(client, uri, T.Position(0, 4))
    assert "looks binary" in e.value.message
    # lone surrogates (a mis-decoded file) are survivable text, not a crash
    uri2 = "file:///w/surrogates.py"
    open_doc(client, uri2, "name = 'caf\udce9'\nx = ")
    assert isinstance(await inline(client, uri2, T.Position(1, 4)), list)


async def test_huge_document_stays_fast_and_the_size_limit_is_explained(client: LanguageClient):
    uri = "file:///w/huge.py"
    body = "".join(f"value_{i} = {i} * 2  # padding to make the line longer\n" for i in range(190_000))
    assert len(body) > 10_000_000
    t0 = time.perf_counter()
    open_doc(client, uri, body)
    last = body.count("\n")
    for k, ch in enumerate("result = "):
        insert(client, uri, 2 + k, T.Position(last, k), ch)
    items = await inline(client, uri, T.Position(last, 9))
    assert isinstance(items, list)
    st = await status(client, uri)
    assert st["document"]["length"] == len(body) + 9
    assert time.perf_counter() - t0 < 90
    await configure(client, maxDocumentBytes=1_000_000)
    try:
        with pytest.raises(JsonRpcException) as e:
            await inline(client, uri, T.Position(last, 9))
        assert "maxDocumentBytes" in e.value.message
    finally:
        await configure(client, maxDocumentBytes=32 * 1024 * 1024)
    client.text_document_did_close(T.DidCloseTextDocumentParams(T.TextDocumentIdentifier(uri)))


async def test_did_change_storm_keeps_up_and_answers_only_the_latest(client: LanguageClient):
    await configure(client, debounceMs=40)
    try:
        uri = "file:///w/storm.py"
        open_doc(client, uri, SAMPLE)
        before = counters(await status(client))
        line, text = SAMPLE.count("\n"), ""
        futures = []
        t0 = time.perf_counter()
        typed = ("x = compute(value) + offset * 2  # " * 40)[:1000]
        for i, ch in enumerate(typed):
            pos = T.Position(line, len(text))
            insert(client, uri, 2 + i, pos, ch)
            text += ch
            futures.append(client.text_document_inline_completion_async(
                inline_params(uri, T.Position(line, len(text)))))
        sent = time.perf_counter() - t0
        results = await asyncio.gather(*futures)
        elapsed = time.perf_counter() - t0
        after = counters(await status(client))
        st = await status(client, uri)
        expected = SAMPLE + typed
        assert st["document"]["sha256"] == hashlib.sha256(expected.encode()).hexdigest()  # kept up: every edit applied
        assert st["document"]["version"] == 1 + len(typed)
        assert len(results) == 1000
        ran = after.get("generations", 0) - before.get("generations", 0)
        dropped = sum(after.get(k, 0) - before.get(k, 0) for k in ("dropped_superseded", "dropped_stale"))
        assert ran <= 10, ran                 # no queue of stale work: a handful of runs for 1000 requests
        assert dropped >= 900
        assert elapsed < 60, (sent, elapsed)
    finally:
        await configure(client, debounceMs=0)


async def test_malformed_json_rpc_gets_answers_not_silence(srv: Server):
    raw = await RawClient.stdio(server=srv.command)
    try:
        raw.request(1, "workspace/executeCommand", {"command": "a3b.status"})   # before initialize
        err = (await raw.response(1))["error"]
        assert err["code"] == -32002 and "initialize" in err["message"]
        raw.notify("textDocument/didOpen", {"textDocument": {"uri": "file:///w/early.py", "languageId": "python",
                                                             "version": 1, "text": "x"}})   # dropped
        await raw.initialize()
        raw.send({"jsonrpc": "2.0", "id": 2, "method": "textDocument/didOpen",       # a notification with an id
                  "params": {"textDocument": {"uri": "file:///w/n.py", "languageId": "python", "version": 1,
                                              "text": "x"}}})
        err = (await raw.response(2))["error"]
        assert err["code"] == -32600 and "is a notification" in err["message"]
        raw.request(3, "workspace/executeCommand", {"command": "a3b.status"})
        assert (await raw.response(3))["result"]["open_documents"] == 0
        raw.send_bytes(b"{this is not json")
        msg = await raw.recv()
        assert msg["error"]["code"] == -32700 and msg["id"] is None
        raw.send_bytes(b"[1, 2]")
        assert (await raw.recv())["error"]["code"] == -32600
        raw.send({"jsonrpc": "1.0", "id": 7, "method": "shutdown"})
        assert (await raw.response(7))["error"]["code"] == -32600
        raw.request(8, "textDocument/inlineCompletion", {"textDocument": {"uri": 5}, "position": {"line": "x"}})
        err = (await raw.response(8))["error"]
        assert err["code"] == -32602 and "textDocument/inlineCompletion" in err["message"]
        raw.request(9, "textDocument/noSuchThing", {})
        assert (await raw.response(9))["error"]["code"] == -32601
        raw.notify("$/unknownNotification", {})           # ignored, as the spec allows
        raw.request(10, "workspace/executeCommand", {"command": "a3b.status"})
        assert "result" in await raw.response(10)           # still serving
        raw.writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # not LSP framing at all
        msg = await raw.recv()
        assert msg["error"]["code"] == -32700 and "Not an LSP header" in msg["error"]["message"]
        assert await asyncio.wait_for(raw.proc.wait(), 20) is not None
    finally:
        await raw.close()


async def test_client_disconnect_mid_generation_ends_the_server_promptly(srv: Server):
    raw = await RawClient.stdio(server=srv.command)
    await raw.initialize(options={"maxTokens": 512, "debounceMs": 0})
    raw.notify("textDocument/didOpen", {"textDocument": {"uri": "file:///w/d.py", "languageId": "python",
                                                         "version": 1, "text": SAMPLE + "\n\nclass A:\n"}})
    raw.request(1, "workspace/executeCommand", {"command": "a3b.explainSelection", "arguments": [
        "file:///w/d.py", {"start": {"line": 0, "character": 0}, "end": {"line": 22, "character": 0}}]})
    await asyncio.sleep(0.5)
    t0 = time.perf_counter()
    raw.writer.close()   # the editor went away
    await asyncio.wait_for(raw.proc.wait(), 30)
    assert time.perf_counter() - t0 < 30
    assert raw.proc.returncode == 0 or raw.proc.returncode == 1   # 1: no shutdown request came first


async def test_fim_model_end_to_end(tmp_path):
    from tinygguf import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "tiny-fim.gguf", "llama", extra_kv={
        "tokenizer.ggml.fim_pre_token_id": 3, "tokenizer.ggml.fim_suf_token_id": 4,
        "tokenizer.ggml.fim_mid_token_id": 5})
    raw = await RawClient.stdio("--model", str(model))
    try:
        await raw.initialize(options={"debounceMs": 0, "nCtx": 256})
        raw.notify("textDocument/didOpen", {"textDocument": {"uri": "file:///w/f.py", "languageId": "python",
                                                             "version": 1, "text": "def f(x):\n    return \n"}})
        raw.request(1, "textDocument/inlineCompletion", {"textDocument": {"uri": "file:///w/f.py"},
                                                         "position": {"line": 1, "character": 11},
                                                         "context": {"triggerKind": 1}})
        res = await raw.response(1)
        assert "items" in res["result"]
        raw.request(2, "workspace/executeCommand", {"command": "a3b.status"})
        st = (await raw.response(2))["result"]
        assert st["server"]["counters"]["prompts_fim"] == 1 and st["model"] == "tiny-fim.gguf"
    finally:
        raw.request(3, "shutdown")
        raw.notify("exit")
        await raw.close()


async def test_clients_without_resolve_get_the_fix_as_a_command(srv: Server):
    from pytest_lsp.client import make_test_lsp_client

    c = make_test_lsp_client()
    applied = []

    @c.feature("workspace/applyEdit")
    def apply_edit(params: T.ApplyWorkspaceEditParams):
        applied.append(params.edit)
        return T.ApplyWorkspaceEditResult(applied=True)

    await c.start_io(*srv.command, "--stdio")
    try:
        await c.initialize_session(T.InitializeParams(capabilities=T.ClientCapabilities(),
                                                      initialization_options={"debounceMs": 0}))
        uri = "file:///w/plain_client.py"
        open_doc(c, uri, "def mean(xs):\n    return sum(xs) / len(xs\n")
        diag = T.Diagnostic(range=T.Range(T.Position(1, 4), T.Position(1, 27)), message="'(' was never closed")
        actions = await c.text_document_code_action_async(T.CodeActionParams(
            text_document=T.TextDocumentIdentifier(uri), range=diag.range,
            context=T.CodeActionContext(diagnostics=[diag])))
        # no code action literals in its capabilities: plain Commands, as the LSP asks
        fix = next(a for a in actions if a.title.startswith("Fix with A3B"))
        assert isinstance(fix, T.Command) and fix.command == "a3b.fix"
        res = await c.workspace_execute_command_async(T.ExecuteCommandParams(
            command=fix.command, arguments=fix.arguments))
        assert res == {"applied": True, "uri": uri}
        assert len(applied) == 1 and applied[0].changes[uri][0].new_text.strip()
        with pytest.raises(JsonRpcException) as e:
            await c.workspace_execute_command_async(T.ExecuteCommandParams(command="a3b.fix", arguments=["x"]))
        assert "takes one argument" in e.value.message
        with pytest.raises(JsonRpcException) as e:
            await c.workspace_execute_command_async(T.ExecuteCommandParams(command="a3b.nothing"))
        assert "Unknown command" in e.value.message
        await c.shutdown_session()
    finally:
        if c._server is not None and c._server.returncode is None:
            c._server.kill()
        await c.stop()
