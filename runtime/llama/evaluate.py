"""What llama.cpp computes for a GGUF: the logits at every position of a sequence.

`LlamaContext` is one llama_model with one single-sequence context, what evaluation here and graph
observation (graph.py) both hold. Each `LlamaEval` owns one and asks for logits at every position:
the served file's own (quantised weights, llama.cpp kernels), what the pruning tool's tests compare
with its reference forward (the benchmarks' perplexity and speed measures build on it).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from ..environment import usable_cpus
from ..errors import ModelLoadFailed
from .binding import fill_batch, llama, sequence
from .weights import Weights


class LlamaContext:
    """A model (`weights`) and a context of `n_ctx` tokens for one sequence, with a batch that holds
    a whole window. `repack=False` keeps the weights on the CPU as pages of the memory-mapped file;
    `cb_eval` is llama.cpp's graph evaluation callback (a ctypes callback the caller keeps alive)."""

    #: what the context is for, in the error when llama.cpp cannot make it
    purpose = "an evaluation"

    def __init__(self, path: str | os.PathLike, n_ctx: int, n_threads: int = 0, n_gpu_layers: int = 0, *,
                 repack: bool = True, cb_eval=None):
        L = llama()
        self.weights = Weights(Path(path), n_gpu_layers=n_gpu_layers, repack=repack)
        self.n_ctx = n_ctx
        self.n_threads = n_threads or usable_cpus()
        p = L.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = p.n_ubatch = n_ctx
        p.n_seq_max = 1
        p.n_threads = p.n_threads_batch = self.n_threads
        p.no_perf = True
        if cb_eval is not None:
            p.cb_eval = cb_eval
            p.cb_eval_user_data = None
        self.ctx = L.llama_init_from_model(self.weights.ptr, p)
        if not self.ctx:
            self.weights.free()
            raise ModelLoadFailed(f"llama.cpp could not create {self.purpose} context for {path}")
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(n_ctx, 0, 1)

    def close(self) -> None:
        if self.ctx:
            L = llama()
            L.llama_batch_free(self.batch)
            L.llama_free(self.ctx)
            self.ctx = None
            self.weights.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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

    def _last_logits(self) -> np.ndarray:
        L = llama()
        ptr = L.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - __del__ must not raise, even at interpreter shutdown
            pass
