"""The language server's parts, each built alone with what it takes (no pygls server, no client):
the completions (Completer), the prompts (Prompts), the low-confidence diagnostics
(SpanDiagnostics), the model's work behind quick fixes (ModelActions) and the code actions
(CodeActions), over the fake engine or plain fakes.

Fast: the fake engine (tests/fakeengine.py) at most.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from lsprotocol import types as T

from comfyui_a3b.lsp_server.actions import CodeActions, ModelActions
from comfyui_a3b.lsp_server.completion import Completer
from comfyui_a3b.lsp_server.config import Settings
from comfyui_a3b.lsp_server.diagnostics import MAX_PENDING_SPANS, SpanDiagnostics
from comfyui_a3b.lsp_server.documents import Document, DocumentError
from comfyui_a3b.lsp_server.engine import Engine
from comfyui_a3b.lsp_server.prompts import Prompts
from comfyui_a3b.lsp_server.session import Session

URI = "file:///w/a.py"
CODE = "def count_words(text):\n    return len\n"
#: the fake model writes this line ("    return len" + it), 8 ms a token
MODEL = "fake://parts?text=(text.split())%0A&delay_ms=8&speculative=off"


def _at(line: int, character: int) -> T.Position:
    return T.Position(line=line, character=character)


def _insert(doc: Document, pos: T.Position, text: str) -> None:
    doc.apply(T.TextDocumentContentChangePartial(range=T.Range(pos, pos), text=text))


@pytest.fixture()
def engine(fake_engine):
    from comfyui_a3b.runtime import get_runtime

    rt = get_runtime()
    eng = Engine(rt, default_model=MODEL)
    yield eng
    eng.close()
    rt.unload(rt.spec(MODEL))


def _completer(engine: Engine, docs: dict, settings: Settings, prompted: list) -> Completer:
    spec = engine.spec_for(settings)

    async def model(progress=None):
        return engine.rt.load(spec)

    def prompt(builder, cur, fim):
        prompted.append(cur.offset)
        return builder.build(cur, anchor=None, context_block="", budget=settings.context_tokens,
                             suffix_tokens=settings.suffix_tokens, use_fim=fim)

    return Completer(engine, docs, lambda: settings, lambda: "utf-16", model, lambda: spec, prompt)


# -- Completer --------------------------------------------------------------------------------------
def test_a_completer_alone_answers_from_the_model_then_from_the_cache(engine):
    docs = {URI: Document(URI, CODE, 1, "python")}
    prompted: list[int] = []
    c = _completer(engine, docs, Settings(debounce_ms=0), prompted)

    async def run():
        first = await c.complete(URI, _at(1, 14))
        again = await c.complete(URI, _at(1, 14))
        return first, again

    first, again = asyncio.run(run())
    assert (first.text, first.source) == ("(text.split())", "model")
    assert (again.text, again.source) == ("(text.split())", "cache_exact")
    assert prompted == [len("def count_words(text):\n    return len")]   # the cache hit built no prompt
    with pytest.raises(DocumentError, match="is not open"):
        asyncio.run(c.complete("file:///w/closed.py", _at(0, 0)))


def test_a_completer_alone_cancels_its_generation_when_the_edit_is_elsewhere(engine):
    docs = {URI: Document(URI, CODE, 1, "python")}
    c = _completer(engine, docs, Settings(debounce_ms=0, max_tokens=200), [])

    async def run():
        ask = asyncio.ensure_future(c.complete(URI, _at(1, 14)))
        while not c.running():
            await asyncio.sleep(0.005)
        _insert(docs[URI], _at(0, 0), "# x\n")
        c.edited(URI, docs[URI])
        return await ask

    answer = asyncio.run(run())
    assert answer.text == "" and not c.running()
    assert engine.stats.c["cancelled_by_edit"] == 1


# -- Prompts ----------------------------------------------------------------------------------------
def test_prompts_alone_keep_the_anchor_and_warm_where_the_cursor_rests(engine):
    settings = Settings(context_chunks=0)
    spec = engine.spec_for(settings)
    docs = {URI: Document(URI, CODE * 40, 1, "python")}
    p = Prompts(engine, docs, lambda: settings, lambda: spec, lambda: engine.rt.loaded(spec), lambda: False)
    p.WARM_PAUSE_S = 0.01
    builder = engine.builder(engine.rt.load(spec))
    doc = docs[URI]
    first = p.prompt(builder, doc.cursor(_at(71, 4), "utf-16"), False)
    later = p.prompt(builder, doc.cursor(_at(71, 14), "utf-16"), False)
    assert later.anchor == first.anchor == p.anchors[URI]         # the window stays put
    p.set_document(URI, None)
    assert URI not in p.anchors

    async def warm():
        p.hint(URI, len(doc) // 2)
        for _ in range(400):
            if engine.stats.c["warmed_tokens"]:
                return
            await asyncio.sleep(0.01)

    asyncio.run(warm())
    assert engine.stats.c["warmed_tokens"] > 0
    p.close()
    asyncio.run(_hint_after_close(p))
    assert p._warm_timer is None                                   # a closed connection warms nothing


async def _hint_after_close(p: Prompts) -> None:
    p.hint(URI, 0)


# -- SpanDiagnostics ---------------------------------------------------------------------------------
def test_span_diagnostics_alone_publish_when_the_text_lands_and_follow_it():
    doc = Document(URI, "x = 1\n", 1, "python")
    sent: list[T.PublishDiagnosticsParams] = []
    d = SpanDiagnostics({URI: doc}, lambda: "utf-16", sent.append)
    d.expect_insert(URI, 6, "y = compute()\n", [(4, 11, 3.2)])
    assert sent == [] and len(d.pending_spans) == 1               # not in the document yet
    _insert(doc, _at(1, 0), "y = compute()\n")
    d.after_change(URI)
    (params,) = sent
    assert params.uri == URI and params.version == 1
    (diag,) = params.diagnostics
    assert diag.range == T.Range(_at(1, 4), _at(1, 11)) and "3.20 nats" in diag.message
    _insert(doc, _at(0, 0), "# a comment\n")                       # the text moves down a line
    d.after_change(URI)
    assert sent[-1].diagnostics[0].range == T.Range(_at(2, 4), _at(2, 11))
    doc.apply(T.TextDocumentContentChangePartial(range=T.Range(_at(2, 0), _at(3, 0)), text=""))
    d.after_change(URI)
    assert sent[-1].diagnostics == [] and d.published[URI] == []  # edited away


def test_span_diagnostics_keep_a_bounded_number_of_pending_spans():
    doc = Document(URI, "x\n", 1, "python")
    d = SpanDiagnostics({URI: doc}, lambda: "utf-16", lambda params: None)
    for i in range(MAX_PENDING_SPANS + 10):
        d.expect_insert(URI, 0, f"never typed {i}", [(0, 5, 3.0)])
    assert len(d.pending_spans) == MAX_PENDING_SPANS


# -- ModelActions ------------------------------------------------------------------------------------
def test_model_actions_alone_fix_a_line_and_find_a_traceback_in_the_workspace(fake_engine, tmp_path):
    from comfyui_a3b.runtime import get_runtime

    fixed = "fake://parts-fix?text=%60%60%60python%0Ay%20%3D%202%0A%60%60%60"   # ```python\ny = 2\n```
    eng = Engine(get_runtime(), default_model=fixed)
    session = Session(eng)
    session.open(URI, "x = 1\ny = z\n", 1, "python")
    (tmp_path / "app.py").write_text("a = 1\nb = c\n")
    actions = ModelActions(session, roots=lambda: [str(tmp_path)])
    try:
        edit, uri, spans, start = asyncio.run(actions.compute_fix(
            {"kind": "diagnostic", "uri": URI, "line": 1, "end_line": 1, "message": "z is undefined"}))
        assert uri == URI and start == 0 and spans == []
        (change,) = edit.changes[URI]
        assert change.new_text == "y = 2" and change.range == T.Range(_at(0, 0), _at(2, 0))   # the line and one around
        tb = f'Traceback (most recent call last):\n  File "{tmp_path}/app.py", line 2, in <module>\nNameError: c\n'
        target = actions._traceback_target(tb, None)
        assert target[0] == (tmp_path / "app.py").as_uri() and target[1:5] == ("a = 1\nb = c\n", 1, 1, "NameError: c")
        with pytest.raises(DocumentError, match="None of the traceback's files"):
            ModelActions(session)._traceback_target(tb, None)   # no workspace: not found
    finally:
        session.close()
        eng.close()
        get_runtime().unload(get_runtime().spec(fixed))


# -- CodeActions -------------------------------------------------------------------------------------
class _FakeModel:
    def __init__(self):
        self.asked: list[dict] = []

    async def compute_fix(self, data):
        self.asked.append(data)
        edit = T.WorkspaceEdit(changes={URI: [T.TextEdit(range=T.Range(_at(0, 0), _at(0, 5)), new_text="x = 2")]})
        return edit, URI, [(4, 5, 2.5)], 0


def _code_actions(literal: bool, resolve: bool, applied: list):
    from comfyui_a3b.lsp_server.messages import strict_converter

    session = SimpleNamespace(docs={URI: Document(URI, "x = 1\n", 3, "python")}, encoding="utf-16")
    session.doc = session.docs.__getitem__
    expected: list[tuple] = []
    diagnostics = SimpleNamespace(expect_insert=lambda *a: expected.append(a))
    caps = {"text_document.code_action.code_action_literal_support": literal,
            "text_document.code_action.resolve_support": resolve}

    async def apply_edit(params):
        applied.append(params)
        return T.ApplyWorkspaceEditResult(applied=True)

    model = _FakeModel()
    return CodeActions(session, model, diagnostics, caps.__getitem__, apply_edit, strict_converter()), model, expected


def _params() -> T.CodeActionParams:
    diag = T.Diagnostic(range=T.Range(_at(0, 0), _at(0, 5)), message="x is\n  wrong")
    return T.CodeActionParams(text_document=T.TextDocumentIdentifier(URI), range=T.Range(_at(0, 0), _at(0, 5)),
                              context=T.CodeActionContext(diagnostics=[diag]))


def test_code_actions_alone_offer_what_the_client_takes():
    applied: list = []
    actions, model, _ = _code_actions(literal=True, resolve=True, applied=applied)
    fix, explain = asyncio.run(actions.code_action(_params()))
    assert fix.title == "Fix with A3B: x is wrong" and fix.command is None and fix.data["version"] == 3
    assert explain.command.command == "a3b.explainSelection" and model.asked == []   # nothing ran yet
    actions, _, _ = _code_actions(literal=True, resolve=False, applied=applied)
    fix, _ = asyncio.run(actions.code_action(_params()))
    assert fix.command.command == "a3b.fix" and fix.command.arguments == [fix.data]
    actions, _, _ = _code_actions(literal=False, resolve=False, applied=applied)
    fix, explain = asyncio.run(actions.code_action(_params()))
    assert isinstance(fix, T.Command) and isinstance(explain, T.Command)


def test_code_actions_alone_resolve_and_apply_a_fix():
    applied: list = []
    actions, model, expected = _code_actions(literal=True, resolve=True, applied=applied)
    data = {"kind": "diagnostic", "uri": URI, "line": 0, "end_line": 0, "message": "m"}
    action = asyncio.run(actions.code_action_resolve(T.CodeAction(title="t", data=data)))
    assert action.edit.changes[URI][0].new_text == "x = 2" and applied == []
    assert expected == [(URI, 0, "x = 2", [(4, 5, 2.5)])]
    assert asyncio.run(actions.fix(data)) == {"applied": True, "uri": URI}
    assert applied[0].label == "A3B fix" and model.asked == [data, data] and len(expected) == 2
    from pygls.exceptions import JsonRpcInvalidParams

    with pytest.raises(JsonRpcInvalidParams, match="one argument"):
        asyncio.run(actions.fix())


# -- the server that holds them --------------------------------------------------------------------
def test_the_server_registers_its_features_and_commands(engine):
    from comfyui_a3b.lsp_server.server import A3BServer

    server = A3BServer(engine, SimpleNamespace(done=False))
    try:
        assert set(server.protocol.fm.features) == {
            T.INITIALIZE, T.INITIALIZED, T.SHUTDOWN, T.WORKSPACE_DID_CHANGE_CONFIGURATION,
            T.TEXT_DOCUMENT_INLINE_COMPLETION, T.TEXT_DOCUMENT_COMPLETION, T.TEXT_DOCUMENT_CODE_ACTION,
            T.CODE_ACTION_RESOLVE, "a3b/cursor"}
        assert list(server.protocol.fm.commands) == ["a3b.status", "a3b.explainSelection", "a3b.fixTraceback",
                                                     "a3b.fix", "a3b.completionAccepted", "a3b.tuneWorkspace"]
        assert server.diagnostics.docs is server.session.docs and server.actions.session is server.session
        assert server.workspace_roots() == []                       # before initialize: no workspace
    finally:
        server.session.close()
