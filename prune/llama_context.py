"""One llama.cpp model with one single-sequence context: what evaluation (llama_eval) and
calibration (llama_stats) both hold.

llama.cpp is imported when a context is made, not with this module, so that importing the
calibration probes stays light.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..runtime.errors import ModelLoadFailed


class LlamaContext:
    """A model (`weights`) and a context of `n_ctx` tokens for one sequence, with a batch that holds
    a whole window. `repack=False` keeps the weights on the CPU as pages of the memory-mapped file;
    `cb_eval` is llama.cpp's graph evaluation callback (a ctypes callback the caller keeps alive)."""

    #: what the context is for, in the error when llama.cpp cannot make it
    purpose = "an evaluation"

    def __init__(self, path: str | os.PathLike, n_ctx: int, n_threads: int = 0, n_gpu_layers: int = 0, *,
                 repack: bool = True, cb_eval=None):
        from ..runtime.llama import Weights, llama

        L = llama()
        self.weights = Weights(Path(path), n_gpu_layers=n_gpu_layers, repack=repack)
        self.n_ctx = n_ctx
        self.n_threads = n_threads or os.cpu_count() or 1
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
        from ..runtime.llama import llama

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
