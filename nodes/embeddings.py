"""What the embedding nodes do (A3BEmbed, A3BTopK), as plain functions over the runtime. No ComfyUI import."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..runtime import LoadSpec, get_runtime
from ..runtime.errors import InvalidRequest
from ..runtime.options import POOLING
from .core import NodeError
from .router import RoutedModel


def split_texts(text: str | Sequence[Any] | None) -> list[str]:
    """One item per non-empty line of a string, or the items of a list (which must all be text)."""
    if text is None:
        raise InvalidRequest("Nothing to embed: give some text (one item per line) or a list of texts.")
    if isinstance(text, str):
        items = [line.strip() for line in text.splitlines()]
        items = [t for t in items if t]
    else:
        items = []
        for i, t in enumerate(text):
            if not isinstance(t, str):
                raise InvalidRequest(f"Item #{i} to embed is a {type(t).__name__}, not text; "
                                     "connect STRING outputs only.")
            if t.strip():
                items.append(t)
    if not items:
        raise InvalidRequest("Nothing to embed: the text is empty. Give one item per line.")
    return items


def embed(spec: LoadSpec, text: str | Sequence[Any], *, pooling: str = POOLING.default,
          normalize: bool = True) -> tuple[np.ndarray, list[str]]:
    if isinstance(spec, RoutedModel):   # a router's embeddings are its default model's
        spec = spec.default
    if not isinstance(spec, LoadSpec):
        raise NodeError(f"'model' must come from an A3BLoader node, got {type(spec).__name__}.")
    texts = split_texts(text)
    vecs = get_runtime().embed(texts, model=spec, pooling=pooling, normalize=normalize)
    return vecs, texts


def top_k(documents: Any, texts: Sequence[str], query: Any, k: int = 3) -> tuple[list[int], list[float]]:
    """Indices and cosine similarities of the k documents closest to the (first) query vector."""
    docs = _as_matrix(documents, "documents")
    q = _as_matrix(query, "query")
    if len(texts) != docs.shape[0]:
        raise InvalidRequest(f"{docs.shape[0]} document embeddings but {len(texts)} texts: connect the "
                             "texts output of the same A3BEmbed node.")
    if q.shape[1] != docs.shape[1]:
        raise InvalidRequest(f"The query has {q.shape[1]} dimensions and the documents {docs.shape[1]}: "
                             "embed both with the same model.")
    if k < 1:
        raise InvalidRequest(f"top_k must be >= 1, got {k}")
    dn = docs / np.maximum(np.linalg.norm(docs, axis=1, keepdims=True), 1e-12)
    qn = q[0] / max(float(np.linalg.norm(q[0])), 1e-12)
    sims = dn @ qn
    order = np.argsort(-sims, kind="stable")[:k]
    return [int(i) for i in order], [float(sims[i]) for i in order]


def _as_matrix(x: Any, what: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    a = np.asarray(x, dtype=np.float32)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[0] == 0:
        raise InvalidRequest(f"The {what} input must be an N x D embedding matrix, got shape {a.shape}.")
    return a


def to_tensor(vecs: np.ndarray):
    """Embeddings as a torch tensor (N x D, float32) when torch is there (inside ComfyUI it is)."""
    try:
        import torch
    except ImportError:
        return vecs
    return torch.from_numpy(np.ascontiguousarray(vecs, dtype=np.float32))
