"""What llama.cpp computes for a GGUF: all-position logits, perplexity, decode speed (no torch).

Each `LlamaEval` owns one llama_model and one context with logits for every position, so perplexity
here is the served file's own (quantised weights, llama.cpp kernels).
"""
from __future__ import annotations

import ctypes
import math
import os
import time

import numpy as np

from ..runtime.errors import ModelLoadFailed
from ..runtime.llama import fill_batch, llama, sequence
from .llama_context import LlamaContext


class LlamaEval(LlamaContext):
    def __init__(self, path: str | os.PathLike, n_ctx: int = 512, n_threads: int = 0, n_gpu_layers: int = 0):
        super().__init__(path, n_ctx, n_threads, n_gpu_layers)
        self.n_vocab = self.weights.n_vocab

    def tokenize(self, text: str) -> list[int]:
        return self.weights.tokenize(text, add_bos=False, special=False)

    @property
    def bos(self) -> int | None:
        return self.weights.bos if self.weights.add_bos and self.weights.bos >= 0 else None

    def _decode(self, tokens: list[int], start: int, all_logits: bool) -> None:
        L = llama()
        fill_batch(self.batch, sequence(tokens, start, all_logits=all_logits))
        rc = L.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise ModelLoadFailed(f"llama_decode failed with status {rc}")

    def logits(self, tokens: list[int]) -> np.ndarray:
        """(len(tokens), n_vocab) float32 logits of one sequence, from an empty cache."""
        if len(tokens) > self.n_ctx:
            raise ValueError(f"{len(tokens)} tokens exceed the evaluation context of {self.n_ctx}")
        L = llama()
        L.llama_memory_clear(self.mem, True)
        self._decode(tokens, 0, True)
        ptr = L.llama_get_logits(self.ctx)
        arr = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                    shape=(len(tokens), self.n_vocab))
        return arr.copy()

    def logits_stepwise(self, tokens: list[int]) -> np.ndarray:
        """Like `logits`, but decoding one token at a time (as generation does) instead of one batch."""
        if len(tokens) > self.n_ctx:
            raise ValueError(f"{len(tokens)} tokens exceed the evaluation context of {self.n_ctx}")
        L = llama()
        L.llama_memory_clear(self.mem, True)
        out = np.empty((len(tokens), self.n_vocab), dtype=np.float32)
        for i, t in enumerate(tokens):
            self._decode([t], i, True)
            out[i] = self._last_logits()
        return out

    def nll(self, seqs: list[list[int]]) -> tuple[float, int]:
        total, n = 0.0, 0
        for s in seqs:
            lg = self.logits(s)[:-1].astype(np.float64)
            m = lg.max(-1, keepdims=True)
            lse = (m[:, 0] + np.log(np.exp(lg - m).sum(-1)))
            total += float((lse - lg[np.arange(len(s) - 1), s[1:]]).sum())
            n += len(s) - 1
        return total, n

    def perplexity(self, seqs: list[list[int]]) -> float:
        total, n = self.nll(seqs)
        return math.exp(total / max(n, 1))

    def decode_speed(self, prompt: list[int], n_tokens: int) -> float:
        """Tokens/s of one-token-at-a-time decoding after `prompt` (greedy, the model's own tokens)."""
        L = llama()
        L.llama_memory_clear(self.mem, True)
        self._decode(prompt, 0, False)
        tok = int(np.argmax(self._last_logits()))
        pos = len(prompt)
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            self._decode([tok], pos, True)
            pos += 1
            tok = int(np.argmax(self._last_logits()))
        return n_tokens / (time.perf_counter() - t0)

    def prefill_speed(self, tokens: list[int]) -> float:
        """Tokens/s of reading `tokens` as one prompt from an empty cache (logits for the last only)."""
        L = llama()
        L.llama_memory_clear(self.mem, True)
        t0 = time.perf_counter()
        self._decode(tokens, 0, False)
        self._last_logits()  # waits for the computation (a GPU computes asynchronously)
        return len(tokens) / (time.perf_counter() - t0)

    def _last_logits(self) -> np.ndarray:
        L = llama()
        ptr = L.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - __del__ must not raise, even at interpreter shutdown
            pass
