"""Context from other open files, chosen by embedding similarity over the same loaded model.

Other open documents are cut into chunks of whole lines. When a completion window is (re)built, the
text before the cursor is embedded and the most similar chunks go into the prompt's stable head.
Chunks *too* similar to the text at the cursor are left out: a near-copy of the current code in the
prompt makes small models repeat it instead of continuing.

Embeddings run at batch priority on the runtime's scheduler, a small pack of chunks at a time, so
an editor request waits at most one pack; chunk vectors are cached by content hash, so only new or
edited chunks are embedded (incremental). A selection looks at the most recently opened or edited
documents first and at most MAX_CANDIDATE_CHUNKS chunks (bounded): with dozens of files open, the
work per selection stays the same.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .documents import Snapshot
from ..runtime.codeheader import comment_for
from .prompt import CHARS_PER_TOKEN

MAX_INDEXED_CHARS = 512 * 1024   # larger files are not indexed (still completed)
MAX_CHUNKS_PER_DOC = 64
MAX_CANDIDATE_CHUNKS = 256       # chunks one selection compares (and may have to embed)


@dataclass(frozen=True)
class Chunk:
    uri: str
    line: int
    text: str
    digest: str


def chunk_text(uri: str, text: str, chunk_tokens: int) -> list[Chunk]:
    """Whole-line chunks of about `chunk_tokens` tokens, preferring to break at blank lines."""
    if len(text) > MAX_INDEXED_CHARS or "\x00" in text:
        return []
    budget = int(chunk_tokens * CHARS_PER_TOKEN)
    out: list[Chunk] = []
    cur: list[str] = []
    size = 0
    start = 0
    for i, line in enumerate(text.split("\n")):
        if cur and (size + len(line) > budget or (not line.strip() and size > budget * 0.6)):
            body = "\n".join(cur).strip("\n")
            if body.strip():
                out.append(Chunk(uri, start, body, hashlib.sha1(body.encode("utf-8", "replace")).hexdigest()))
            cur, size, start = [], 0, i
            if len(out) >= MAX_CHUNKS_PER_DOC:
                return out
        cur.append(line[:budget])
        size += len(line) + 1
    body = "\n".join(cur).strip("\n")
    if body.strip():
        out.append(Chunk(uri, start, body, hashlib.sha1(body.encode("utf-8", "replace")).hexdigest()))
    return out


class ContextIndex:
    """Chunks of one editor session's open documents and a shared cache of their vectors."""

    def __init__(self, vectors: VectorCache):
        self.vectors = vectors
        self.docs: dict[str, list[Chunk]] = {}
        self._texts: dict[str, str | Snapshot] = {}

    def set_document(self, uri: str, text: str | Snapshot | None, chunk_tokens: int) -> None:
        """The text of `uri` now (a Snapshot is joined only when a selection chunks it), or None
        once it is closed."""
        self._texts.pop(uri, None)   # re-inserted last: _texts is ordered by recency of use
        if text is None:
            self.docs.pop(uri, None)
            return
        self._texts[uri] = text
        self.docs.pop(uri, None)  # re-chunked lazily, at the next selection

    def _chunks(self, chunk_tokens: int, exclude: str, limit: int = MAX_CANDIDATE_CHUNKS) -> list[Chunk]:
        """Chunks of the most recently used documents other than `exclude`, at most `limit`."""
        out: list[Chunk] = []
        for uri, text in reversed(list(self._texts.items())):  # the event loop may add documents meanwhile
            if uri == exclude:
                continue
            chunks = self.docs.get(uri)
            if chunks is None:
                if isinstance(text, Snapshot):
                    text = text.text() if len(text) <= MAX_INDEXED_CHARS else ""
                chunks = self.docs[uri] = chunk_text(uri, text, chunk_tokens)
            out.extend(chunks[:limit - len(out)])
            if len(out) >= limit:
                break
        return out

    def select(self, embed, uri: str, query: str, k: int, max_similarity: float,
               chunk_tokens: int) -> list[tuple[Chunk, float]]:
        """The `k` chunks of other documents most similar to `query` (blocking: call off the loop)."""
        if k <= 0 or not query.strip():
            return []
        chunks = self._chunks(chunk_tokens, exclude=uri)
        if not chunks:
            return []
        qv = embed([query[-int(chunk_tokens * 2 * CHARS_PER_TOKEN):]])[0]
        mat = self.vectors.get_many(embed, chunks)
        sims = mat @ qv
        order = np.argsort(-sims)
        picked = []
        for i in order:
            if sims[i] > max_similarity:
                continue  # near-copies of the code at the cursor make the model repeat it
            picked.append((chunks[i], float(sims[i])))
            if len(picked) >= k:
                break
        return picked


class VectorCache:
    def __init__(self, max_items: int = 4096):
        self.max_items = max_items
        self._v: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.embedded = 0

    def get_many(self, embed, chunks: list[Chunk]) -> np.ndarray:
        key = getattr(embed, "model_key", "")
        found: dict[str, np.ndarray] = {}
        with self._lock:
            for c in chunks:
                v = self._v.get((key, c.digest))
                if v is not None:
                    found[c.digest] = v
        missing = list({c.digest: c for c in chunks if c.digest not in found}.values())
        if missing:
            vecs = embed([c.text for c in missing])
            with self._lock:
                for c, v in zip(missing, vecs):
                    found[c.digest] = self._v[(key, c.digest)] = v
                    self.embedded += 1
                while len(self._v) > self.max_items:
                    self._v.popitem(last=False)
        return np.stack([found[c.digest] for c in chunks])


def render_block(chunks: list[tuple[Chunk, float]], language_id: str) -> str:
    """The prompt head for the chosen chunks, each captioned with its file and line."""
    if not chunks:
        return ""
    cm = comment_for(language_id)
    parts = []
    for c, _ in chunks:
        name = c.uri.rsplit("/", 1)[-1]
        parts.append(f"{cm} from {name}, line {c.line + 1}:\n{c.text}\n")
    return "\n".join(parts) + "\n"
