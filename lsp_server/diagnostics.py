"""Low-confidence diagnostics: spans of an accepted suggestion the model was unsure of.

When a suggestion or a fix lands in a document, its low-confidence spans are published as
Information diagnostics; they follow their text as the user edits around it and vanish once it is
edited away. A suggestion's text is looked for near where it was expected, since the client may
insert it a little elsewhere or after other edits.
"""
from __future__ import annotations

from collections.abc import Callable

from lsprotocol import types as T

from .documents import Document

#: Pending low-confidence spans kept per connection while their text has not appeared yet.
MAX_PENDING_SPANS = 32


def _find_near(doc, text: str, start: int, end: int) -> int:
    """Offset of `text` in the document between `start` and `end` (clipped), or -1."""
    start = max(0, start)
    i = doc.slice(start, end).find(text)
    return -1 if i < 0 else start + i


class SpanDiagnostics:
    """The low-confidence diagnostics of a connection."""

    def __init__(self, docs: dict[str, Document], encoding: Callable[[], str],
                 publish: Callable[[T.PublishDiagnosticsParams], None]):
        """`docs` the connection's open documents, `encoding()` its position encoding, `publish`
        sends textDocument/publishDiagnostics."""
        self.docs = docs
        self.encoding = encoding
        self.publish = publish
        self.published: dict[str, list[tuple[int, int, str, str]]] = {}   # uri -> (start, end, text, message)
        self.pending_spans: list[tuple[str, int, str, list]] = []         # (uri, offset, text, spans)

    def expect_insert(self, uri: str, offset: int, text: str, spans: list) -> None:
        """After `text` lands at `offset` of `uri`, publish its low-confidence spans."""
        if spans:
            self.pending_spans.append((uri, offset, text, spans))
            self.after_change(uri)

    def after_change(self, uri: str) -> None:
        """Publish spans whose text has arrived, and move or drop those already published."""
        doc = self.docs.get(uri)
        if doc is None or not (self.published.get(uri) or any(p[0] == uri for p in self.pending_spans)):
            return
        placed = self._place_pending(uri, doc)
        moved = self._follow_published(uri, doc)
        if placed or moved:
            enc = self.encoding()
            diagnostics = [T.Diagnostic(range=doc.range_at(s, e, enc), message=msg,
                                        severity=T.DiagnosticSeverity.Information, source="a3b")
                           for s, e, _, msg in self.published.get(uri, [])]
            self.publish(T.PublishDiagnosticsParams(uri=uri, version=doc.version, diagnostics=diagnostics))

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
