"""The pygls language server: LSP features over the engine. One server object per connection.

pygls' own TCP and WebSocket servers drive a single protocol object (one editor at a time) and
exit the process on `exit`; here every connection gets its own server and protocol (see
transport.py), sharing one Engine, and `exit` only closes that connection.
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import re
import time
from typing import Any

from lsprotocol import types as T
from pygls.capabilities import ServerCapabilitiesBuilder
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams, JsonRpcRequestCancelled
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol, lsp_method

from ..runtime import PRIORITY_INTERACTIVE, ConfidenceConfig, preset
from ..runtime.errors import A3BError, Cancelled
from . import fixes
from .documents import DocumentError
from .engine import Engine, Session, _spans_in

log = logging.getLogger("a3b.lsp")

COMMANDS = ("a3b.status", "a3b.explainSelection", "a3b.fixTraceback", "a3b.fix", "a3b.completionAccepted")
REQUEST_FAILED = -32803


def _version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("comfyui-a3b")
    except Exception:
        return "0"


class RequestFailed(JsonRpcException):
    """An A3B error as an LSP error response (RequestFailed), message unchanged."""

    CODE = REQUEST_FAILED


def lsp_error(e: Exception) -> JsonRpcException:
    if isinstance(e, DocumentError):
        return JsonRpcInvalidParams(str(e))
    return RequestFailed(str(e), data={"code": getattr(e, "code", type(e).__name__)})


class A3BProtocol(LanguageServerProtocol):
    """Document sync through the engine's Document (see documents.py), and a per-connection exit."""

    _server: "A3BServer"

    @lsp_method(T.EXIT)
    def lsp_exit(self, *args):
        self._server.connection.close(0 if self._shutdown else 1)

    @lsp_method(T.WORKSPACE_EXECUTE_COMMAND)
    async def lsp_workspace__execute_command(self, params: T.ExecuteCommandParams):
        # pygls runs commands through a generator whose inner task $/cancelRequest cannot reach;
        # as a coroutine of its own, a command is cancelled like any other request
        handler = self.fm.commands.get(params.command)
        if handler is None:
            raise JsonRpcInvalidParams(f"Unknown command {params.command!r}; A3B has {', '.join(COMMANDS)}.")
        result = handler(*(params.arguments or []))
        if inspect.isawaitable(result):
            result = await result
        return result

    @lsp_method(T.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: T.DidOpenTextDocumentParams):
        d = params.text_document
        self._server.session.open(d.uri, d.text, d.version, d.language_id)

    @lsp_method(T.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: T.DidChangeTextDocumentParams):
        s = self._server.session
        try:
            s.change(params.text_document.uri, params.text_document.version, params.content_changes)
        except DocumentError as e:
            self._server.show(T.MessageType.Error, f"A3B could not apply an edit: {e} Close and reopen the file.")
        else:
            self._server.after_change(params.text_document.uri)

    @lsp_method(T.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: T.DidCloseTextDocumentParams):
        self._server.session.close_doc(params.text_document.uri)


class A3BServer(LanguageServer):
    def __init__(self, engine: Engine, connection):
        super().__init__("a3b", _version(), text_document_sync_kind=T.TextDocumentSyncKind.Incremental,
                         protocol_cls=A3BProtocol)
        self.engine = engine
        self.connection = connection
        self.session = Session(engine, notify=lambda level, msg: self.show(
            T.MessageType.Error if level == "error" else T.MessageType.Info, msg))
        self._progress_ids = itertools.count(1)
        self.published: dict[str, list[tuple[int, int, str, str]]] = {}   # uri -> (start, end, text, message)
        self.pending_spans: list[tuple[str, int, str, list]] = []         # (uri, offset, text, spans)
        _register(self)

    # -- helpers ---------------------------------------------------------------------------------
    def show(self, kind: T.MessageType, message: str) -> None:
        self.window_show_message(T.ShowMessageParams(type=kind, message=message))

    def report_server_error(self, error: Exception, source) -> None:
        # request errors travel in their response; notifications' failures are shown once
        from pygls.exceptions import FeatureRequestError

        if source is FeatureRequestError:
            return
        log.warning("server error: %s", error)
        self.show(T.MessageType.Error, f"A3B: {error}")

    def supports(self, path: str) -> bool:
        cur: Any = self.client_capabilities
        for part in path.split("."):
            cur = getattr(cur, part, None)
            if cur is None:
                return False
        return bool(cur)

    def progress_for_load(self):
        """A callback that shows model loading as window/workDoneProgress, when the client has it."""
        if not self.supports("window.work_done_progress"):
            return None

        def start(name: str):
            token = f"a3b-load-{next(self._progress_ids)}"
            t0 = time.perf_counter()
            self.work_done_progress.create(token)
            self.work_done_progress.begin(token, T.WorkDoneProgressBegin(title="A3B", message=f"loading {name}"))

            def done():
                self.work_done_progress.end(token, T.WorkDoneProgressEnd(
                    message=f"{name} ready in {(time.perf_counter() - t0) * 1000:.0f} ms"))
            return done

        return start

    # -- low-confidence diagnostics --------------------------------------------------------------
    def expect_insert(self, uri: str, offset: int, text: str, spans: list) -> None:
        """After `text` lands at `offset` of `uri`, publish its low-confidence spans."""
        if spans:
            self.pending_spans.append((uri, offset, text, spans))
            self.after_change(uri)

    def after_change(self, uri: str) -> None:
        doc = self.session.docs.get(uri)
        if doc is None:
            return
        changed = False
        keep = []
        for item in self.pending_spans:
            puri, off, text, spans = item
            if puri != uri:
                keep.append(item)
                continue
            at = doc.text.find(text, max(0, off - 200), off + len(text) + 200) if text else -1
            if at < 0:
                keep.append(item) if len(keep) < 32 else None
                continue
            for s, e, ent in spans:
                self.published.setdefault(uri, []).append(
                    (at + s, at + e, text[s:e], f"A3B is unsure here (mean entropy {ent:.2f} nats): check this part."))
            changed = True
        self.pending_spans = keep
        # spans already published follow their text, and vanish once it is edited away
        old = self.published.get(uri, [])
        moved = []
        for s, e, t, msg in old:
            at = doc.text.find(t, max(0, s - 500), e + 500)
            if at >= 0:
                moved.append((at, at + len(t), t, msg))
        if moved != old:
            changed = True
            self.published[uri] = moved
        if changed:
            enc = self.session.encoding
            self.text_document_publish_diagnostics(T.PublishDiagnosticsParams(uri=uri, version=doc.version, diagnostics=[
                T.Diagnostic(range=doc.range_at(s, e, enc), message=msg, severity=T.DiagnosticSeverity.Information,
                             source="a3b") for s, e, _, msg in self.published.get(uri, [])]))

    # -- model-backed actions (shared by code actions and commands) -------------------------------
    async def chat(self, messages, max_tokens: int, confidence: bool = False):
        s = self.session
        await s.model(self.progress_for_load())
        stream = s.engine.rt.submit(model=s.spec(), messages=messages, max_tokens=max_tokens,
                                    sampling=preset("greedy"), priority=PRIORITY_INTERACTIVE,
                                    confidence=ConfidenceConfig(enabled=confidence,
                                                                threshold=s.settings.confidence_threshold))
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.shield(loop.run_in_executor(s.engine.executor, stream.result))
        except asyncio.CancelledError:
            stream.cancel("request cancelled")
            raise

    async def compute_fix(self, data: dict) -> tuple[T.WorkspaceEdit, str, list, int]:
        """(edit, uri, spans, offset) for a fix described by a code action's `data`."""
        kind = data.get("kind")
        if kind == "traceback":
            uri, text, first, last, problem, lang = self._traceback_target(data.get("text", ""), data.get("uri"))
        elif kind == "diagnostic":
            uri = data["uri"]
            doc = self.session.doc(uri)
            text, lang = doc.text, doc.language_id
            first, last = int(data["line"]), int(data["end_line"])
            if first >= doc.line_count():
                raise DocumentError(f"Line {first} is outside {uri} ({doc.line_count()} lines).")
            problem = data.get("message") or "an error"
        else:
            raise DocumentError(f"Unknown fix kind {kind!r}.")
        a, b, code = fixes.line_window(text, first, last, around=1)
        res = await self.chat(fixes.fix_messages(code, problem, lang or ""), max_tokens=200, confidence=True)
        new = fixes.extract_code(res.text, code)
        if not new.strip():
            raise A3BError(f"The model gave no code for this fix (it answered {res.text[:80]!r}).")
        lines = text.split("\n")
        end_char = len(lines[b])
        rng = T.Range(start=T.Position(line=a, character=0), end=T.Position(line=b, character=_units(lines[b], end_char, self.session.encoding)))
        edit = T.WorkspaceEdit(changes={uri: [T.TextEdit(range=rng, new_text=new)]})
        start = sum(len(ln) + 1 for ln in lines[:a])
        return edit, uri, _spans_in(res.spans, new), start

    def _traceback_target(self, tb_text: str, origin: str | None):
        tb = fixes.parse_traceback(tb_text)
        if tb is None:
            raise DocumentError("No Python traceback found (it starts with 'Traceback (most recent call last):').")
        roots = [f.uri for f in (self.workspace.folders.values() if self.protocol._workspace else [])]
        roots = [fixes.uri_to_path(r) for r in roots if fixes.uri_to_path(r)]
        if self.workspace.root_path:
            roots.append(self.workspace.root_path)
        for fr in reversed(tb.frames):
            for uri, doc in self.session.docs.items():
                p = fixes.uri_to_path(uri)
                if p and (p == fr.path or p.endswith("/" + fr.path.lstrip("./"))):
                    return uri, doc.text, fr.line - 1, fr.line - 1, tb.error, doc.language_id
            text = fixes.read_source(fr.path, roots)
            if text is not None:
                from pygls.uris import from_fs_path

                return from_fs_path(fr.path), text, fr.line - 1, fr.line - 1, tb.error, "python"
        raise DocumentError("None of the traceback's files is open or inside the workspace: "
                            + ", ".join(f'{f.path}:{f.line}' for f in tb.frames[-3:]))


def _units(line: str, index: int, encoding: str) -> int:
    from .documents import _index_to_units

    return _index_to_units(line[:index], encoding)


def _guard(coro_fn):
    """Turn runtime and document errors into clear LSP error responses."""
    import functools

    @functools.wraps(coro_fn)
    async def wrapped(*args, **kwargs):
        try:
            return await coro_fn(*args, **kwargs)
        except Cancelled as e:
            raise JsonRpcRequestCancelled(str(e)) from e
        except (DocumentError, A3BError) as e:
            raise lsp_error(e) from e
    return wrapped


def _register(ls: A3BServer) -> None:
    s = ls.session

    @ls.feature(T.INITIALIZE)
    def initialize(params: T.InitializeParams):
        enc = ServerCapabilitiesBuilder.choose_position_encoding(params.capabilities)
        s.encoding = getattr(enc, "value", enc)
        for err in s.configure(params.initialization_options):
            ls.show(T.MessageType.Warning, err)

    @ls.feature(T.INITIALIZED)
    async def initialized(params: T.InitializedParams):
        try:
            await s.model(ls.progress_for_load())
        except A3BError as e:
            ls.show(T.MessageType.Error, f"A3B could not load its model: {e}")

    @ls.feature(T.WORKSPACE_DID_CHANGE_CONFIGURATION)
    async def did_change_configuration(params: T.DidChangeConfigurationParams):
        before = s.spec() if s._spec is not None else None
        for err in s.configure(params.settings):
            ls.show(T.MessageType.Warning, err)
        try:
            if before != s.spec():
                await s.model(ls.progress_for_load())
        except A3BError as e:
            ls.show(T.MessageType.Error, f"A3B could not load the configured model: {e}")

    @ls.feature(T.TEXT_DOCUMENT_INLINE_COMPLETION, T.InlineCompletionOptions())
    @_guard
    async def inline_completion(params: T.InlineCompletionParams):
        a = await s.complete(params.text_document.uri, params.position, ls.progress_for_load())
        if not a.text:
            return T.InlineCompletionList(items=[])
        pos = params.position
        cmd = None
        if a.spans:
            cmd = T.Command(title="A3B: accepted", command="a3b.completionAccepted",
                            arguments=[a.cursor.uri, a.cursor.offset, a.text, [list(x) for x in a.spans]])
        return T.InlineCompletionList(items=[T.InlineCompletionItem(
            insert_text=a.text, range=T.Range(start=pos, end=pos), command=cmd)])

    @ls.feature(T.TEXT_DOCUMENT_COMPLETION, T.CompletionOptions(resolve_provider=False))
    @_guard
    async def completion(params: T.CompletionParams):
        a = await s.complete(params.text_document.uri, params.position, ls.progress_for_load())
        if not a.text:
            return T.CompletionList(is_incomplete=True, items=[])
        # replace the word being typed, so the client's filtering keeps the item
        typed = re.search(r"\w*$", a.cursor.line_prefix).group(0)
        start = T.Position(line=params.position.line, character=params.position.character - _units(typed, len(typed), s.encoding))
        first = a.text.split("\n", 1)[0]
        label = (typed + first).strip() or a.text.strip().split("\n", 1)[0]
        return T.CompletionList(is_incomplete=True, items=[T.CompletionItem(
            label=label[:80], kind=T.CompletionItemKind.Text, detail="A3B", filter_text=typed + a.text,
            sort_text="0", text_edit=T.TextEdit(range=T.Range(start=start, end=params.position), new_text=typed + a.text),
            insert_text_format=T.InsertTextFormat.PlainText)])

    @ls.feature(T.TEXT_DOCUMENT_CODE_ACTION, T.CodeActionOptions(
        code_action_kinds=[T.CodeActionKind.QuickFix], resolve_provider=True))
    @_guard
    async def code_action(params: T.CodeActionParams):
        uri = params.text_document.uri
        doc = s.doc(uri)
        enc = s.encoding
        a = doc.offset_at(params.range.start, enc, "range start")
        b = doc.offset_at(params.range.end, enc, "range end")
        resolve = ls.supports("text_document.code_action.resolve_support")
        literals = ls.supports("text_document.code_action.code_action_literal_support")
        actions = []

        def action(title: str, data: dict, diagnostics=None):
            if not literals:  # such clients only take Command objects
                return T.Command(title=title, command="a3b.fix", arguments=[data])
            act = T.CodeAction(title=title, kind=T.CodeActionKind.QuickFix, diagnostics=diagnostics, data=data)
            if not resolve:  # the client cannot resolve: run the same fix as a command
                act.command = T.Command(title=title, command="a3b.fix", arguments=[data])
            return act

        for d in (params.context.diagnostics or [])[:3]:
            msg = " ".join(d.message.split())
            actions.append(action(f"Fix with A3B: {msg[:60]}", {
                "kind": "diagnostic", "uri": uri, "version": doc.version, "line": d.range.start.line,
                "end_line": d.range.end.line, "message": d.message}, [d]))
        selected = doc.text[min(a, b):max(a, b)] if a != b else doc.line_text(params.range.start.line)
        window = doc.text[max(0, min(a, b) - 4000):max(a, b) + 4000]
        tb_text = selected if fixes.TRACEBACK_START in selected else window
        if fixes.parse_traceback(tb_text) is not None:
            actions.append(action("Fix traceback with A3B", {"kind": "traceback", "uri": uri, "text": tb_text}))
        if a != b:
            explain = T.Command(title="Explain with A3B", command="a3b.explainSelection", arguments=[uri, params.range])
            actions.append(T.CodeAction(title="Explain with A3B", kind=T.CodeActionKind.Empty, command=explain)
                           if literals else explain)
        return actions

    @ls.feature(T.CODE_ACTION_RESOLVE)
    @_guard
    async def code_action_resolve(action: T.CodeAction):
        data = action.data if isinstance(action.data, dict) else None
        if data is None:
            raise DocumentError("This code action has no A3B data to resolve.")
        edit, uri, spans, start = await ls.compute_fix(data)
        action.edit = edit
        new_text = edit.changes[uri][0].new_text
        ls.expect_insert(uri, start, new_text, spans)
        return action

    async def apply_fix(data: dict):
        edit, uri, spans, start = await ls.compute_fix(data)
        res = await ls.workspace_apply_edit_async(T.ApplyWorkspaceEditParams(edit=edit, label="A3B fix"))
        ls.expect_insert(uri, start, edit.changes[uri][0].new_text, spans)
        return {"applied": bool(res and res.applied), "uri": uri}

    @ls.command("a3b.fix")
    @_guard
    async def cmd_fix(*args: Any):
        if len(args) != 1 or not isinstance(args[0], dict):
            raise DocumentError("a3b.fix takes one argument: the data of an A3B code action.")
        return await apply_fix(args[0])

    @ls.command("a3b.fixTraceback")
    @_guard
    async def cmd_fix_traceback(*args: Any):
        if not args or not isinstance(args[0], str):
            raise DocumentError("a3b.fixTraceback takes the traceback text as its first argument.")
        return await apply_fix({"kind": "traceback", "text": args[0]})

    @ls.command("a3b.explainSelection")
    @_guard
    async def cmd_explain(*args: Any):
        try:
            uri, r = args[0], ls.protocol._converter.structure(args[1], T.Range)
            assert isinstance(uri, str)
        except Exception:
            raise DocumentError("a3b.explainSelection takes a document URI and a range "
                                "({start: {line, character}, end: {...}}).") from None
        doc = s.doc(uri)
        a = doc.offset_at(r.start, s.encoding, "range start")
        b = doc.offset_at(r.end, s.encoding, "range end")
        code = doc.text[min(a, b):max(a, b)][:6000]
        if not code.strip():
            raise DocumentError("Select some code to explain.")
        res = await ls.chat(fixes.explain_messages(code, doc.language_id), max_tokens=160)
        return {"explanation": res.text.strip(), "tokens": res.n_tokens}

    @ls.command("a3b.status")
    def cmd_status(*args: Any):
        rt = s.engine.rt
        st = rt.status()
        m = s.model_if_loaded()
        out = {"server": s.engine.status(), "model": m.name if m else None,
               "model_path": s.spec().path, "settings": _settings(s), "open_documents": len(s.docs),
               "context_files": {uri: files for uri, (_, files) in s.context.items()},
               "generating": ({"uri": s.gen.cur.uri, "chars": len(s.gen.text)}
                              if s.gen is not None and not s.gen.done.done() else None),
               "runtime": {k: st[k] for k in ("pid", "rss_bytes", "memory_bytes", "weight_loads", "models")}}
        if args and isinstance(args[0], str) and args[0] in s.docs:  # a document's state, for checks
            import hashlib

            d = s.docs[args[0]]
            out["document"] = {"uri": d.uri, "version": d.version, "length": len(d.text), "lines": d.line_count(),
                               "sha256": hashlib.sha256(d.text.encode("utf-8", "surrogatepass")).hexdigest()}
        return out

    @ls.command("a3b.completionAccepted")
    def cmd_accepted(*args: Any):
        uri, offset, text, spans = (list(args) + [None] * 4)[:4]
        if isinstance(uri, str) and isinstance(offset, int) and isinstance(text, str) and isinstance(spans, list):
            ls.expect_insert(uri, offset, text, [tuple(x) for x in spans if isinstance(x, list) and len(x) == 3])
        return None


def _settings(s: Session) -> dict:
    from .config import as_dict

    return as_dict(s.settings)
