"""What A3B answers over LSP: one method per request, notification or command, and the table
that registers them with the connection's server (server.py). The code actions and the commands
that run the model are in actions.py (`CodeActions`); tuning in tuning.py.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
from typing import Any

from lsprotocol import types as T
from pygls.capabilities import ServerCapabilitiesBuilder
from pygls.lsp.server import LanguageServer

from ..runtime.errors import A3BError
from . import tuning
from .actions import CodeActions
from .config import as_dict
from .documents import DocumentError, _units
from .errors import _guard
from .postprocess import word_before

#: A3B's own notification: the editor's cursor position, for warming the prompt there.
CURSOR_NOTIFICATION = "a3b/cursor"


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

    def __init__(self, server: LanguageServer):
        """Over `server` (the connection's A3BServer, server.py): its session, model actions and
        diagnostics, capabilities and messages."""
        self.server = server
        self.session = server.session
        self.actions = CodeActions(server.session, server.actions, server.diagnostics, server.supports,
                                   server.workspace_apply_edit_async, server.converter)

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
                code_action_kinds=[T.CodeActionKind.QuickFix], resolve_provider=True), self.actions.code_action),
            (T.CODE_ACTION_RESOLVE, None, self.actions.code_action_resolve),
            (CURSOR_NOTIFICATION, None, self.cursor),
        ):
            ls.feature(method, options)(_plain(handler))
        for command, handler in (
            ("a3b.status", self.status),
            ("a3b.explainSelection", self.actions.explain_selection),
            ("a3b.fixTraceback", self.actions.fix_traceback),
            ("a3b.fix", self.actions.fix),
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
               "context_files": {uri: files for uri, (_, files) in s.prompts.context.items()},
               "generating": ({"uri": s.completer.gen.cur.uri, "chars": len(s.completer.gen.text)}
                              if s.completer.running() else None),
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
            self.server.diagnostics.expect_insert(uri, offset, text,
                                      [tuple(x) for x in spans if isinstance(x, list) and len(x) == 3])
