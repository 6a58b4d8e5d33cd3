"""The benchmarks' measures of a GGUF as llama.cpp runs it: held-out perplexity, prompt and decode
speed, over the runtime's all-position evaluation (runtime/llama/evaluate.py)."""
from __future__ import annotations

import math
import time

import numpy as np

from ..runtime.llama import llama
from ..runtime.llama.evaluate import LlamaEval as _LlamaEval


class LlamaEval(_LlamaEval):
    """The runtime's evaluation context with perplexity and speed."""

    def nll(self, seqs: list[list[int]]) -> tuple[float, int]:
        """Summed negative log-likelihood of every next token of `seqs`, and how many tokens that is."""
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
        llama().llama_memory_clear(self.mem, True)
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
        llama().llama_memory_clear(self.mem, True)
        t0 = time.perf_counter()
        self._decode(tokens, 0, False)
        self._last_logits()  # waits for the computation (a GPU computes asynchronously)
        return len(tokens) / (time.perf_counter() - t0)
