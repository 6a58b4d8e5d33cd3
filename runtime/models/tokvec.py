"""A model's input token vectors (its `token_embd.weight` table), read from the GGUF file as llama.cpp
maps it: a request's text becomes a vector by a table lookup, with no pass through the model.

The table is memory-mapped (numpy over the file, the same pages the loaded model maps), and only the
rows a text uses are dequantised (the `gguf` package's own dequantisation), so this adds no copy of
the weights and costs a few microseconds per token. What such a vector knows is which tokens a text
uses, not what they mean together: good enough to tell code from prose (runtime/routing.py), far
weaker than the model's pooled output embedding.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidRequest

TABLE = "token_embd.weight"


class TokenVectors:
    """Rows of a GGUF's token-embedding table, dequantised on demand."""

    def __init__(self, path: str):
        import gguf

        try:
            reader = gguf.GGUFReader(path, "r")
        except (OSError, ValueError) as e:
            raise InvalidRequest(f"Cannot read the token vectors of {path}: {e}") from e
        table = next((t for t in reader.tensors if t.name == TABLE), None)
        if table is None:
            raise InvalidRequest(f"{path} has no {TABLE} tensor: its token vectors cannot embed requests; "
                                 "route with route_embedding=model instead.")
        self.qtype = table.tensor_type
        self.data = table.data   # a view of the memory-mapped file: rows are read when they are used
        self.n_vocab = int(self.data.shape[0])
        self.n_embd = int(table.shape[0])
        self._dequantize = gguf.quants.dequantize

    def rows(self, ids: list[int]) -> np.ndarray:
        """The vectors of tokens `ids` (ids outside the table are skipped), float32, one row each."""
        keep = np.asarray([i for i in ids if 0 <= i < self.n_vocab], dtype=np.int64)
        if keep.size == 0:
            return np.zeros((0, self.n_embd), dtype=np.float32)
        raw = np.asarray(self.data[keep])
        out = self._dequantize(raw, self.qtype) if raw.dtype == np.uint8 else raw
        return np.asarray(out, dtype=np.float32).reshape(len(keep), self.n_embd)

    def mean(self, ids: list[int]) -> np.ndarray:
        """The mean vector of the distinct tokens in `ids` (zeros for none)."""
        rows = self.rows(sorted(set(ids)))
        return rows.mean(axis=0) if len(rows) else np.zeros(self.n_embd, dtype=np.float32)


__all__ = ["TABLE", "TokenVectors"]
