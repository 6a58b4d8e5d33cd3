"""The pygls language server: LSP features over the engine. One server object per connection.

pygls' own TCP and WebSocket servers drive a single protocol object (one editor at a time) and
exit the process on `exit`; here every connection gets its own server and protocol (see
transport.py), sharing one Engine, and `exit` only closes that connection.

Where each message goes:

* `A3BProtocol` replaces pygls' built-in handlers for document sync (the engine keeps its own
  documents, see documents.py), `exit` and `workspace/executeCommand`;
* `Features` answers everything else, one method per request, notification or command;
  `Features.register` is the table of which LSP method (with which capability options) goes to
  which method; the code actions and the commands that run the model are in actions.py;
* `A3BServer` holds the connection's state and what several features share: messages to the user,
  load progress, the low-confidence diagnostics (diagnostics.py) and the model-backed fixes
  (actions.py).
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import logging
import time
from typing import Any

from lsprotocol import types as T
from pygls.capabilities import ServerCapabilitiesBuilder
from pygls.exceptions import FeatureRequestError, JsonRpcInvalidParams
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol, lsp_method

from ..runtime.errors import A3BError
from .actions import ActionFeatures, ModelActions
from .config import as_dict
from .diagnostics import SpanDiagnostics
from .documents import DocumentError, _units
from .errors import _guard
from .messages import Refusals, install_log_filter, strict_converter
from .postprocess import word_before
from . import tuning
from .session import Engine, Session

log = logging.getLogger("a3b.lsp")
install_log_filter()

#: A3B's own notification: the editor's cursor position, for warming the prompt there.
CURSOR_NOTIFICATION = "a3b/cursor"


def _version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("comfyui-a3b")
    except Exception:  # noqa: BLE001 - not installed as a distribution: any version will do
        return "0"


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
class A3BServer(SpanDiagnostics, ModelActions, LanguageServer):
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


class Features(ActionFeatures):
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
            ("a3b.tuneWorkspace", self.tune_workspace),
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

    # -- commands --------------------------------------------------------------------------------
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

    @_guard
    async def tune_workspace(self, *args: Any) -> dict:
        """a3b.tuneWorkspace([folder], [options]): tune an adapter on the workspace (tuning.py)."""
        return await tuning.tune_workspace(self.server, self.session, *args)

    def completion_accepted(self, *args: Any) -> None:
        """a3b.completionAccepted(uri, offset, text, spans): the client inserted a suggestion; its
        low-confidence spans become Information diagnostics once the text is in the document."""
        uri, offset, text, spans = (list(args) + [None] * 4)[:4]
        if isinstance(uri, str) and isinstance(offset, int) and isinstance(text, str) and isinstance(spans, list):
            self.server.expect_insert(uri, offset, text,
                                      [tuple(x) for x in spans if isinstance(x, list) and len(x) == 3])
