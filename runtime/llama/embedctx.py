"""The embedding contexts over one llama_model: one per pooling type, made on first use, and the
pooled vectors of a pack of texts. Only the worker thread calls them (through the backend)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import EmbeddingsUnsupported
from ..options import LoadSpec
from .binding import fill_batch, llama, log_mark, log_since, sequence
from .contexts import context_params


class EmbeddingContexts:
    def __init__(self, weights: Any, spec: LoadSpec):
        self.weights = weights
        self.spec = spec
        self.ectxs: dict[str, Any] = {}   # pooling -> embedding context, made on first use
        self.ebatch = None

    def _context(self, pooling: str):
        ctx = self.ectxs.get(pooling)
        if ctx:
            return ctx
        L = llama()
        mark = log_mark()
        with self.weights.use():
            ctx = L.llama_init_from_model(self.weights.ptr, context_params(self.spec, embeddings=True, pooling=pooling))
        if not ctx:
            detail = " | ".join(ln.strip() for ln in log_since(mark).splitlines() if "error" in ln.lower())
            raise EmbeddingsUnsupported(f"llama.cpp could not create a {pooling}-pooling embedding context for "
                                        f"{self.weights.info.name}: {detail or 'no detail'}")
        self.ectxs[pooling] = ctx
        if self.ebatch is None:
            self.ebatch = L.llama_batch_init(self.spec.embed_n_ctx, 0, 1)
        return ctx

    def embed(self, token_lists: list[list[int]], pooling: str) -> np.ndarray:
        L = llama()
        ctx = self._context(pooling)
        # one output row per text: llama.cpp pools over the whole sequence anyway, and every
        # flagged row would also reserve a logits row of n_vocab floats
        fill_batch(self.ebatch, (item for s, toks in enumerate(token_lists) for item in sequence(toks, 0, s)))
        mem = L.llama_get_memory(ctx)
        if mem:
            L.llama_memory_clear(mem, False)  # metadata only: zeroing would touch every page
        rc = (L.llama_encode if self.weights.has_encoder else L.llama_decode)(ctx, self.ebatch)
        if rc != 0:
            raise EmbeddingsUnsupported(f"llama.cpp failed to compute embeddings (code {rc}).")
        out = np.empty((len(token_lists), self.weights.n_embd), dtype=np.float32)
        for s in range(len(token_lists)):
            ptr = L.llama_get_embeddings_seq(ctx, s)
            if not ptr:
                raise EmbeddingsUnsupported(f"{self.weights.info.name} returned no pooled embedding.")
            out[s] = np.ctypeslib.as_array(ptr, shape=(self.weights.n_embd,))
        return out

    def close(self) -> None:
        L = llama()
        if self.ebatch is not None:
            L.llama_batch_free(self.ebatch)
            self.ebatch = None
        for ctx in self.ectxs.values():
            L.llama_free(ctx)
        self.ectxs.clear()
