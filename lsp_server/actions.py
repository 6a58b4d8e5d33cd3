"""Model-backed code actions and commands: quick fixes (for a diagnostic or a traceback) and Explain.

Offering an action costs nothing: the model runs only when the client resolves it or runs the
command. `ModelActions` runs the model (the chat request, computing a fix, finding a traceback's
file); `CodeActions` answers the LSP requests and commands with it, and Features (features.py)
registers those handlers.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from lsprotocol import types as T
from pygls.uris import from_fs_path

from ..runtime import PRIORITY_INTERACTIVE, ConfidenceConfig, preset
from ..runtime.errors import A3BError
from . import fixes
from .completion import _spans_in
from .diagnostics import SpanDiagnostics
from .documents import DocumentError, _units
from .errors import _guard
from .session import Session


class ModelActions:
    """The model's work behind quick fixes and explanations."""

    def __init__(self, session: Session, progress: Callable[[], Any] = lambda: None,
                 roots: Callable[[], list[str]] = list):
        """`session` the connection's documents, settings and model; `progress()` the callback that
        shows a model load (or None); `roots()` the local paths of the workspace's folders."""
        self.session = session
        self.progress = progress
        self.roots = roots

    async def chat(self, messages, max_tokens: int, confidence: bool = False):
        """Run a greedy chat request at interactive priority; cancelling the caller cancels it."""
        s = self.session
        await s.model(self.progress())
        conf = ConfidenceConfig(enabled=confidence, threshold=s.settings.confidence_threshold)
        stream = s.engine.rt.submit(model=s.spec(), messages=messages, max_tokens=max_tokens, confidence=conf,
                                    sampling=preset("greedy"), priority=PRIORITY_INTERACTIVE,
                                    thinking=s.settings.thinking, reasoning_budget=s.settings.reasoning_budget,
                                    speculative=s.settings.speculative)
        result = asyncio.get_running_loop().run_in_executor(s.engine.executor, stream.result)
        try:
            return await asyncio.shield(result)
        except asyncio.CancelledError:
            stream.cancel("request cancelled")
            # it ends with Cancelled that nobody awaits: read it, or asyncio logs it with a traceback
            result.add_done_callback(lambda f: f.cancelled() or f.exception())
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

    def _traceback_target(self, tb_text: str, origin: str | None):
        """(uri, text, first line, last line, error, language) of the innermost frame A3B can read."""
        tb = fixes.parse_traceback(tb_text)
        if tb is None:
            raise DocumentError("No Python traceback found (it starts with 'Traceback (most recent call last):').")
        roots = self.roots()
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


class CodeActions:
    """The quick fixes and Explain: code actions, their resolution and the commands that run them."""

    def __init__(self, session: Session, model: ModelActions, diagnostics: SpanDiagnostics,
                 supports: Callable[[str], bool], apply_edit: Callable[[T.ApplyWorkspaceEditParams], Awaitable[Any]],
                 converter):
        """`supports(path)` whether the client has a capability; `apply_edit` sends
        workspace/applyEdit; `converter` structures command arguments as messages are."""
        self.session = session
        self.model = model
        self.diagnostics = diagnostics
        self.supports = supports
        self.apply_edit = apply_edit
        self.converter = converter

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
                           if self.supports("text_document.code_action.code_action_literal_support")
                           else explain)
        return actions

    def _fix_action(self, title: str, data: dict, diagnostics=None) -> T.CodeAction | T.Command:
        """A quick fix in the form the client takes: a resolvable action, an action with a command,
        or a bare command."""
        command = T.Command(title=title, command="a3b.fix", arguments=[data])
        if not self.supports("text_document.code_action.code_action_literal_support"):
            return command  # such clients only take Command objects
        act = T.CodeAction(title=title, kind=T.CodeActionKind.QuickFix, diagnostics=diagnostics, data=data)
        if not self.supports("text_document.code_action.resolve_support"):
            act.command = command  # the client cannot resolve: run the same fix as a command
        return act

    @_guard
    async def code_action_resolve(self, action: T.CodeAction) -> T.CodeAction:
        """Run the model for a quick fix and return the action with its WorkspaceEdit."""
        data = action.data if isinstance(action.data, dict) else None
        if data is None:
            raise DocumentError("This code action has no A3B data to resolve.")
        edit, uri, spans, start = await self.model.compute_fix(data)
        action.edit = edit
        self.diagnostics.expect_insert(uri, start, edit.changes[uri][0].new_text, spans)
        return action

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
        edit, uri, spans, start = await self.model.compute_fix(data)
        res = await self.apply_edit(T.ApplyWorkspaceEditParams(edit=edit, label="A3B fix"))
        self.diagnostics.expect_insert(uri, start, edit.changes[uri][0].new_text, spans)
        return {"applied": bool(res and res.applied), "uri": uri}

    @_guard
    async def explain_selection(self, *args: Any) -> dict:
        """a3b.explainSelection(uri, range): the model's explanation of the selected code."""
        s = self.session
        try:
            uri, r = args[0], self.converter.structure(args[1], T.Range)
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
        res = await self.model.chat(fixes.explain_messages(code, doc.language_id), max_tokens=160)
        return {"explanation": res.text.strip(), "tokens": res.n_tokens}

