"""The pygls language server: LSP features over the engine. One server object per connection.

pygls' own TCP and WebSocket servers drive a single protocol object (one editor at a time) and
exit the process on `exit`; here every connection gets its own server and protocol (see
transport.py), sharing one Engine, and `exit` only closes that connection.

Where each message goes:

* `A3BProtocol` replaces pygls' built-in handlers for document sync (the engine keeps its own
  documents, see documents.py), `exit` and `workspace/executeCommand`;
* `Features` (features.py) answers everything else, one method per request, notification or
  command, and registers them on the server;
* `A3BServer` is pygls' server object of the connection. It holds the connection's parts, each
  built with what it needs: the Session (session.py: documents, settings, model, completions),
  the low-confidence diagnostics (diagnostics.py), the model's work behind quick fixes
  (actions.py) and the Features; and what several of them share: messages to the user, the
  client's capabilities, load progress and the workspace's folders.
"""
from __future__ import annotations

import inspect
import itertools
import logging
import time
from typing import Any

from lsprotocol import types as T
from pygls.exceptions import FeatureRequestError, JsonRpcInvalidParams
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol, lsp_method

from . import fixes
from .actions import ModelActions
from .diagnostics import SpanDiagnostics
from .documents import DocumentError
from .engine import Engine
from .features import CURSOR_NOTIFICATION, Features
from .messages import Refusals, install_log_filter, strict_converter
from .pygls_compat import has_workspace
from .session import Session

__all__ = ["A3BProtocol", "A3BServer", "CURSOR_NOTIFICATION"]

log = logging.getLogger("a3b.lsp")
install_log_filter()


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
            ls.diagnostics.after_change(params.text_document.uri)

    @lsp_method(T.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: T.DidCloseTextDocumentParams):
        self.owner.session.close_doc(params.text_document.uri)


# -- server ---------------------------------------------------------------------------------------
class A3BServer(LanguageServer):
    """One connection: its session over the shared engine, its parts, and what several share."""

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
        self.diagnostics = SpanDiagnostics(self.session.docs, lambda: self.session.encoding,
                                           self.text_document_publish_diagnostics)
        self.actions = ModelActions(self.session, self.progress_for_load, self.workspace_roots)
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

    def workspace_roots(self) -> list[str]:
        """Local paths of the workspace folders and root, where traceback files are looked up."""
        if not has_workspace(self):
            return []
        roots = [fixes.uri_to_path(f.uri) for f in self.workspace.folders.values()]
        roots = [r for r in roots if r]
        if self.workspace.root_path:
            roots.append(self.workspace.root_path)
        return roots
