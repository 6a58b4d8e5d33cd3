"""The pygls language server: LSP features over the engine. One server object per connection.

pygls' own TCP and WebSocket servers drive a single protocol object (one editor at a time) and
exit the process on `exit`; here every connection gets its own server and protocol (see
transport.py), sharing one Engine, and `exit` only closes that connection.

Where each message goes:

* `A3BProtocol` replaces pygls' built-in handlers for document sync (the engine keeps its own
  documents, see documents.py), `exit` and `workspace/executeCommand`;
* `Features` answers everything else, one method per request, notification or command;
  `Features.register` is the table of which LSP method (with which capability options) goes to
  which method;
* `A3BServer` holds the connection's state and what several features share: messages to the user,
  load progress, the low-confidence diagnostics and the model-backed fixes.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import itertools
import logging
import time
from typing import Any

from lsprotocol import types as T
from pygls.capabilities import ServerCapabilitiesBuilder
from pygls.exceptions import (
    FeatureRequestError,
    JsonRpcException,
    JsonRpcInvalidParams,
    JsonRpcRequestCancelled,
)
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol, lsp_method
from pygls.uris import from_fs_path

from ..runtime import PRIORITY_INTERACTIVE, ConfidenceConfig, preset
from ..runtime.errors import A3BError, Cancelled
from . import fixes
from .config import as_dict
from .documents import DocumentError, _index_to_units
from .completion import _spans_in
from .session import Engine, Session
from .messages import Refusals, install_log_filter, strict_converter
from .postprocess import word_before
from .pygls_compat import has_workspace

log = logging.getLogger("a3b.lsp")
install_log_filter()

REQUEST_FAILED = -32803
#: A3B's own notification: the editor's cursor position, for warming the prompt there.
CURSOR_NOTIFICATION = "a3b/cursor"
#: Pending low-confidence spans kept per connection while their text has not appeared yet.
MAX_PENDING_SPANS = 32


def _version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("comfyui-a3b")
    except Exception:  # noqa: BLE001 - not installed as a distribution: any version will do
        return "0"


# -- errors ---------------------------------------------------------------------------------------
class RequestFailed(JsonRpcException):
    """An A3B error as an LSP error response (RequestFailed), message unchanged."""

    CODE = REQUEST_FAILED


def lsp_error(e: Exception) -> JsonRpcException:
    if isinstance(e, DocumentError):
        return JsonRpcInvalidParams(str(e))
    return RequestFailed(str(e), data={"code": getattr(e, "code", type(e).__name__)})


def _guard(coro_fn):
    """Turn runtime and document errors into clear LSP error responses."""

    @functools.wraps(coro_fn)
    async def wrapped(*args, **kwargs):
        try:
            return await coro_fn(*args, **kwargs)
        except Cancelled as e:
            raise JsonRpcRequestCancelled(str(e)) from e
        except (DocumentError, A3BError) as e:
            raise lsp_error(e) from e
    return wrapped


def _units(line: str, index: int, encoding: str) -> int:
    return _index_to_units(line[:index], encoding)


def _find_near(doc, text: str, start: int, end: int) -> int:
    """Offset of `text` in the document between `start` and `end` (clipped), or -1."""
    start = max(0, start)
    i = doc.slice(start, end).find(text)
    return -1 if i < 0 else start + i


# -- protocol -------------------------------------------------------------------------------------
class A3BProtocol(LanguageServerProtocol):
    """pygls' protocol with A3B's own document sync, a per-connection exit and cancellable commands.

    These replace pygls' built-in handlers of the same LSP methods (pygls finds them by `lsp_method`).
    Documents live in the session (documents.py: indexed lines, size checks), not in pygls' workspace,
    so a 10 MB file is held and edited once.
    """

    def __init__(self, server: A3BServer, converter):
        super().__init__(server, converter)
        self.owner = server     # pygls keeps it too, privately

    @lsp_method(T.EXIT)
    def lsp_exit(self, *args):
        """Close this connection only (pygls' own exit ends the process)."""
        self.owner.connection.close(0 if self.owner.shutdown_requested else 1)

    @lsp_method(T.WORKSPACE_EXECUTE_COMMAND)
    async def lsp_workspace__execute_command(self, params: T.ExecuteCommandParams):
        # pygls runs commands through a generator whose inner task $/cancelRequest cannot reach;
        # as a coroutine of its own, a command is cancelled like any other request
        handler = self.fm.commands.get(params.command)
        if handler is None:
            raise JsonRpcInvalidParams(f"Unknown command {params.command!r}; A3B has {', '.join(self.fm.commands)}.")
        result = handler(*(params.arguments or []))
        if inspect.isawaitable(result):
            result = await result
        return result

    @lsp_method(T.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: T.DidOpenTextDocumentParams):
        d = params.text_document
        self.owner.session.open(d.uri, d.text, d.version, d.language_id)

    @lsp_method(T.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: T.DidChangeTextDocumentParams):
        ls = self.owner
        try:
            ls.session.change(params.text_document.uri, params.text_document.version, params.content_changes)
        except DocumentError as e:
            ls.refusals.add(T.MessageType.Error, "could not apply an edit", str(e), "Close and reopen the file.")
        else:
            ls.after_change(params.text_document.uri)

    @lsp_method(T.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: T.DidCloseTextDocumentParams):
        self.owner.session.close_doc(params.text_document.uri)


# -- server ---------------------------------------------------------------------------------------
class A3BServer(LanguageServer):
    """One connection: its session over the shared engine, and what several features share."""

    def __init__(self, engine: Engine, connection):
        converter = strict_converter()
        super().__init__("a3b", _version(), text_document_sync_kind=T.TextDocumentSyncKind.Incremental,
                         protocol_cls=A3BProtocol, converter_factory=lambda: converter)
        #: the converter pygls structures messages with, to structure command arguments alike
        self.converter = converter
        self.engine = engine
        self.connection = connection
        self.refusals = Refusals(self.show, lambda: connection.done)
        self.session = Session(engine, notify=lambda level, msg: self.show(
            T.MessageType.Error if level == "error" else T.MessageType.Info, msg))
        self.shutdown_requested = False
        self._progress_ids = itertools.count(1)
        self.published: dict[str, list[tuple[int, int, str, str]]] = {}   # uri -> (start, end, text, message)
        self.pending_spans: list[tuple[str, int, str, list]] = []         # (uri, offset, text, spans)
        self.features = Features(self)
        self.features.register()

    # -- messages and capabilities ---------------------------------------------------------------
    def show(self, kind: T.MessageType, message: str) -> None:
        self.window_show_message(T.ShowMessageParams(type=kind, message=message))

    def report_server_error(self, error: Exception, source) -> None:
        """Show a failed notification once; a failed request's error travels in its response."""
        if source is FeatureRequestError:
            return
        log.warning("server error: %s", error)
        self.show(T.MessageType.Error, f"A3B: {error}")

    def supports(self, path: str) -> bool:
        """Whether the client's capabilities have `path` (dotted attribute names) set."""
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
        """Publish spans whose text has arrived, and move or drop those already published."""
        doc = self.session.docs.get(uri)
        if doc is None or not (self.published.get(uri) or any(p[0] == uri for p in self.pending_spans)):
            return
        placed = self._place_pending(uri, doc)
        moved = self._follow_published(uri, doc)
        if placed or moved:
            enc = self.session.encoding
            diagnostics = [T.Diagnostic(range=doc.range_at(s, e, enc), message=msg,
                                        severity=T.DiagnosticSeverity.Information, source="a3b")
                           for s, e, _, msg in self.published.get(uri, [])]
            self.text_document_publish_diagnostics(T.PublishDiagnosticsParams(uri=uri, version=doc.version,
                                                                              diagnostics=diagnostics))

    def _place_pending(self, uri: str, doc) -> bool:
        """Turn pending spans of `uri` whose text is now near its offset into published ones."""
        placed = False
        keep = []
        for item in self.pending_spans:
            puri, off, inserted, spans = item
            if puri != uri:
                keep.append(item)
                continue
            at = _find_near(doc, inserted, off - 200, off + len(inserted) + 200) if inserted else -1
            if at < 0:
                if len(keep) < MAX_PENDING_SPANS:
                    keep.append(item)
                continue
            for s, e, ent in spans:
                self.published.setdefault(uri, []).append(
                    (at + s, at + e, inserted[s:e],
                     f"A3B is unsure here (mean entropy {ent:.2f} nats): check this part."))
            placed = True
        self.pending_spans = keep
        return placed

    def _follow_published(self, uri: str, doc) -> bool:
        """Published spans follow their text, and vanish once it is edited away. True if any changed."""
        old = self.published.get(uri, [])
        moved = []
        for s, e, t, msg in old:
            at = _find_near(doc, t, s - 500, e + 500)
            if at >= 0:
                moved.append((at, at + len(t), t, msg))
        if moved == old:
            return False
        self.published[uri] = moved
        return True

    # -- model-backed actions (shared by code actions and commands) -------------------------------
    async def chat(self, messages, max_tokens: int, confidence: bool = False):
        """Run a greedy chat request at interactive priority; cancelling the caller cancels it."""
        s = self.session
        await s.model(self.progress_for_load())
        conf = ConfidenceConfig(enabled=confidence, threshold=s.settings.confidence_threshold)
        stream = s.engine.rt.submit(model=s.spec(), messages=messages, max_tokens=max_tokens, confidence=conf,
                                    sampling=preset("greedy"), priority=PRIORITY_INTERACTIVE,
                                    thinking=s.settings.thinking, reasoning_budget=s.settings.reasoning_budget)
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
        end = T.Position(line=b, character=_units(lines[b], len(lines[b]), self.session.encoding))
        rng = T.Range(start=T.Position(line=a, character=0), end=end)
        edit = T.WorkspaceEdit(changes={uri: [T.TextEdit(range=rng, new_text=new)]})
        start = sum(len(ln) + 1 for ln in lines[:a])
        return edit, uri, _spans_in(res.spans, new), start

    def _workspace_roots(self) -> list[str]:
        """Local paths of the workspace folders and root, where traceback files are looked up."""
        if not has_workspace(self):
            return []
        roots = [fixes.uri_to_path(f.uri) for f in self.workspace.folders.values()]
        roots = [r for r in roots if r]
        if self.workspace.root_path:
            roots.append(self.workspace.root_path)
        return roots

    def _traceback_target(self, tb_text: str, origin: str | None):
        """(uri, text, first line, last line, error, language) of the innermost frame A3B can read."""
        tb = fixes.parse_traceback(tb_text)
        if tb is None:
            raise DocumentError("No Python traceback found (it starts with 'Traceback (most recent call last):').")
        roots = self._workspace_roots()
        for fr in reversed(tb.frames):
            for uri, doc in self.session.docs.items():
                p = fixes.uri_to_path(uri)
                if p and (p == fr.path or p.endswith("/" + fr.path.lstrip("./"))):
                    return uri, doc.text, fr.line - 1, fr.line - 1, tb.error, doc.language_id
            text = fixes.read_source(fr.path, roots)
            if text is not None:
                return from_fs_path(fr.path), text, fr.line - 1, fr.line - 1, tb.error, "python"
        raise DocumentError("None of the traceback's files is open or inside the workspace: "
                            + ", ".join(f'{f.path}:{f.line}' for f in tb.frames[-3:]))


# -- features -------------------------------------------------------------------------------------
def _plain(method):
    """`method` as a plain function: pygls sets attributes on what it registers, and a bound
    method takes none."""
    if inspect.iscoroutinefunction(method):
        async def call(*args):
            return await method(*args)
    else:
        def call(*args):
            return method(*args)
    return functools.update_wrapper(call, method)


class Features:
    """What A3B answers: one method per LSP request, notification or command.

    `register` is the one place that says which LSP method goes to which method here. Methods
    marked `@_guard` answer runtime and document errors as LSP error responses, and a cancelled
    generation as RequestCancelled.
    """

    def __init__(self, server: A3BServer):
        self.server = server
        self.session = server.session

    def register(self) -> None:
        """Register every feature (with its capability options) and command with pygls."""
        ls = self.server
        for method, options, handler in (
            (T.INITIALIZE, None, self.initialize),
            (T.INITIALIZED, None, self.initialized),
            (T.SHUTDOWN, None, self.shutdown),
            (T.WORKSPACE_DID_CHANGE_CONFIGURATION, None, self.did_change_configuration),
            (T.TEXT_DOCUMENT_INLINE_COMPLETION, T.InlineCompletionOptions(), self.inline_completion),
            (T.TEXT_DOCUMENT_COMPLETION, T.CompletionOptions(resolve_provider=False), self.completion),
            (T.TEXT_DOCUMENT_CODE_ACTION, T.CodeActionOptions(
                code_action_kinds=[T.CodeActionKind.QuickFix], resolve_provider=True), self.code_action),
            (T.CODE_ACTION_RESOLVE, None, self.code_action_resolve),
            (CURSOR_NOTIFICATION, None, self.cursor),
        ):
            ls.feature(method, options)(_plain(handler))
        for command, handler in (
            ("a3b.status", self.status),
            ("a3b.explainSelection", self.explain_selection),
            ("a3b.fixTraceback", self.fix_traceback),
            ("a3b.fix", self.fix),
            ("a3b.completionAccepted", self.completion_accepted),
        ):
            ls.command(command)(_plain(handler))

    # -- lifecycle and settings ------------------------------------------------------------------
    def initialize(self, params: T.InitializeParams) -> None:
        """Negotiate the position encoding and apply initializationOptions as settings.

        pygls answers the request itself (capabilities from `register`) once this returns.
        """
        s = self.session
        enc = ServerCapabilitiesBuilder.choose_position_encoding(params.capabilities)
        s.encoding = getattr(enc, "value", enc)
        for err in s.configure(params.initialization_options):
            self.server.show(T.MessageType.Warning, err)

    async def initialized(self, params: T.InitializedParams) -> None:
        """Load the model now, so the first completion does not wait for it."""
        try:
            await self.session.model(self.server.progress_for_load())
        except A3BError as e:
            self.server.show(T.MessageType.Error, f"A3B could not load its model: {e}")

    def shutdown(self, params: None) -> None:
        """Remember the shutdown request: `exit` after it is a clean exit (code 0)."""
        self.server.shutdown_requested = True

    async def did_change_configuration(self, params: T.DidChangeConfigurationParams) -> None:
        """Apply new settings; load the model at once if they name another one."""
        s = self.session
        before = s.spec() if s._spec is not None else None
        for err in s.configure(params.settings):
            self.server.show(T.MessageType.Warning, err)
        try:
            if before != s.spec():
                await s.model(self.server.progress_for_load())
        except A3BError as e:
            self.server.show(T.MessageType.Error, f"A3B could not load the configured model: {e}")

    def cursor(self, params: Any) -> None:
        """`a3b/cursor` {textDocument: {uri}, position}: where the editor's cursor rests (A3B's own
        VS Code and Neovim integrations send it when the cursor settles or a file gets focus). The
        prompt a completion there would use is read in the background, so the first request is fast.
        Malformed or stale notices are ignored: this is a hint, never an error."""
        try:
            uri = params.textDocument.uri
            pos = T.Position(line=int(params.position.line), character=int(params.position.character))
            self.session.hint_position(uri, pos)
        except (AttributeError, TypeError, ValueError, DocumentError):
            return

    # -- completions -----------------------------------------------------------------------------
    @_guard
    async def inline_completion(self, params: T.InlineCompletionParams) -> T.InlineCompletionList:
        """One inline suggestion at the cursor (empty list: nothing to suggest).

        A suggestion with low-confidence spans carries the command `a3b.completionAccepted`, which
        the client runs on acceptance, so the spans become diagnostics on the inserted text.
        """
        a = await self.session.complete(params.text_document.uri, params.position, self.server.progress_for_load())
        if not a.text:
            return T.InlineCompletionList(items=[])
        pos = params.position
        cmd = None
        if a.spans:
            cmd = T.Command(title="A3B: accepted", command="a3b.completionAccepted",
                            arguments=[a.cursor.uri, a.cursor.offset, a.text, [list(x) for x in a.spans]])
        return T.InlineCompletionList(items=[T.InlineCompletionItem(
            insert_text=a.text, range=T.Range(start=pos, end=pos), command=cmd)])

    @_guard
    async def completion(self, params: T.CompletionParams) -> T.CompletionList:
        """The inline suggestion as one completion item, for clients without inline completions.

        The item replaces the word being typed with that word plus the suggestion, so the client's
        filtering keeps it; the list is incomplete, so the client asks again as the user types.
        """
        s = self.session
        a = await s.complete(params.text_document.uri, params.position, self.server.progress_for_load())
        if not a.text:
            return T.CompletionList(is_incomplete=True, items=[])
        typed = word_before(a.cursor.line_prefix)
        start = T.Position(line=params.position.line,
                           character=params.position.character - _units(typed, len(typed), s.encoding))
        first = a.text.split("\n", 1)[0]
        label = (typed + first).strip() or a.text.strip().split("\n", 1)[0]
        return T.CompletionList(is_incomplete=True, items=[T.CompletionItem(
            label=label[:80], kind=T.CompletionItemKind.Text, detail="A3B", filter_text=typed + a.text,
            sort_text="0",
            text_edit=T.TextEdit(range=T.Range(start=start, end=params.position), new_text=typed + a.text),
            insert_text_format=T.InsertTextFormat.PlainText)])

    # -- quick fixes -----------------------------------------------------------------------------
    @_guard
    async def code_action(self, params: T.CodeActionParams) -> list:
        """Fixes for the diagnostics in range, a fix for a traceback near it, and Explain for a selection.

        Titles cost nothing: the model runs only when the client resolves an action (or runs the
        `a3b.fix` command, for clients that cannot resolve).
        """
        uri = params.text_document.uri
        doc = self.session.doc(uri)
        enc = self.session.encoding
        a = doc.offset_at(params.range.start, enc, "range start")
        b = doc.offset_at(params.range.end, enc, "range end")
        actions = []
        for d in (params.context.diagnostics or [])[:3]:
            msg = " ".join(d.message.split())
            actions.append(self._fix_action(f"Fix with A3B: {msg[:60]}", {
                "kind": "diagnostic", "uri": uri, "version": doc.version, "line": d.range.start.line,
                "end_line": d.range.end.line, "message": d.message}, [d]))
        selected = doc.slice(min(a, b), max(a, b)) if a != b else doc.line_text(params.range.start.line)
        window = doc.slice(min(a, b) - 4000, max(a, b) + 4000)
        tb_text = fixes.traceback_excerpt(selected if fixes.TRACEBACK_START in selected else window)
        if tb_text is not None and fixes.parse_traceback(tb_text) is not None:
            actions.append(self._fix_action("Fix traceback with A3B",
                                            {"kind": "traceback", "uri": uri, "text": tb_text}))
        if a != b:
            explain = T.Command(title="Explain with A3B", command="a3b.explainSelection", arguments=[uri, params.range])
            actions.append(T.CodeAction(title="Explain with A3B", kind=T.CodeActionKind.Empty, command=explain)
                           if self.server.supports("text_document.code_action.code_action_literal_support")
                           else explain)
        return actions

    def _fix_action(self, title: str, data: dict, diagnostics=None) -> T.CodeAction | T.Command:
        """A quick fix in the form the client takes: a resolvable action, an action with a command,
        or a bare command."""
        command = T.Command(title=title, command="a3b.fix", arguments=[data])
        if not self.server.supports("text_document.code_action.code_action_literal_support"):
            return command  # such clients only take Command objects
        act = T.CodeAction(title=title, kind=T.CodeActionKind.QuickFix, diagnostics=diagnostics, data=data)
        if not self.server.supports("text_document.code_action.resolve_support"):
            act.command = command  # the client cannot resolve: run the same fix as a command
        return act

    @_guard
    async def code_action_resolve(self, action: T.CodeAction) -> T.CodeAction:
        """Run the model for a quick fix and return the action with its WorkspaceEdit."""
        data = action.data if isinstance(action.data, dict) else None
        if data is None:
            raise DocumentError("This code action has no A3B data to resolve.")
        edit, uri, spans, start = await self.server.compute_fix(data)
        action.edit = edit
        self.server.expect_insert(uri, start, edit.changes[uri][0].new_text, spans)
        return action

    # -- commands --------------------------------------------------------------------------------
    @_guard
    async def fix(self, *args: Any) -> dict:
        """a3b.fix(data): compute the fix a code action describes and apply it (workspace/applyEdit)."""
        if len(args) != 1 or not isinstance(args[0], dict):
            raise DocumentError("a3b.fix takes one argument: the data of an A3B code action.")
        return await self._apply_fix(args[0])

    @_guard
    async def fix_traceback(self, *args: Any) -> dict:
        """a3b.fixTraceback(text): fix the innermost frame of a traceback that A3B can read."""
        if not args or not isinstance(args[0], str):
            raise DocumentError("a3b.fixTraceback takes the traceback text as its first argument.")
        return await self._apply_fix({"kind": "traceback", "text": args[0]})

    async def _apply_fix(self, data: dict) -> dict:
        ls = self.server
        edit, uri, spans, start = await ls.compute_fix(data)
        res = await ls.workspace_apply_edit_async(T.ApplyWorkspaceEditParams(edit=edit, label="A3B fix"))
        ls.expect_insert(uri, start, edit.changes[uri][0].new_text, spans)
        return {"applied": bool(res and res.applied), "uri": uri}

    @_guard
    async def explain_selection(self, *args: Any) -> dict:
        """a3b.explainSelection(uri, range): the model's explanation of the selected code."""
        s = self.session
        try:
            uri, r = args[0], self.server.converter.structure(args[1], T.Range)
            if not isinstance(uri, str):
                raise TypeError(uri)
        except Exception:  # noqa: BLE001 - any malformed argument gets the same usage message
            raise DocumentError("a3b.explainSelection takes a document URI and a range "
                                "({start: {line, character}, end: {...}}).") from None
        doc = s.doc(uri)
        a = doc.offset_at(r.start, s.encoding, "range start")
        b = doc.offset_at(r.end, s.encoding, "range end")
        code = doc.slice(min(a, b), min(max(a, b), min(a, b) + 6000))
        if not code.strip():
            raise DocumentError("Select some code to explain.")
        res = await self.server.chat(fixes.explain_messages(code, doc.language_id), max_tokens=160)
        return {"explanation": res.text.strip(), "tokens": res.n_tokens}

    def status(self, *args: Any) -> dict:
        """a3b.status([uri]): model, settings, memory and statistics; with an open document's URI,
        that document's state too (version, length, hash: what tests compare)."""
        s = self.session
        st = s.engine.rt.status()
        m = s.model_if_loaded()
        out = {"server": s.engine.status(), "model": m.name if m else None,
               "model_path": s.spec().path, "settings": as_dict(s.settings), "open_documents": len(s.docs),
               "context_files": {uri: files for uri, (_, files) in s.context.items()},
               "generating": ({"uri": s.gen.cur.uri, "chars": len(s.gen.text)}
                              if s.gen is not None and not s.gen.done.done() else None),
               "runtime": {k: st[k] for k in ("pid", "rss_bytes", "memory_bytes", "weight_loads", "models")}}
        if args and isinstance(args[0], str) and args[0] in s.docs:
            d = s.docs[args[0]]
            out["document"] = {"uri": d.uri, "version": d.version, "length": len(d.text), "lines": d.line_count(),
                               "sha256": hashlib.sha256(d.text.encode("utf-8", "surrogatepass")).hexdigest()}
        return out

    def completion_accepted(self, *args: Any) -> None:
        """a3b.completionAccepted(uri, offset, text, spans): the client inserted a suggestion; its
        low-confidence spans become Information diagnostics once the text is in the document."""
        uri, offset, text, spans = (list(args) + [None] * 4)[:4]
        if isinstance(uri, str) and isinstance(offset, int) and isinstance(text, str) and isinstance(spans, list):
            self.server.expect_insert(uri, offset, text,
                                      [tuple(x) for x in spans if isinstance(x, list) and len(x) == 3])
