"""Confidence spans on the real model: the entropies are the plain formula's, to the last bit, whether
a step's rows are computed one after another or side by side in the sampling threads with reused
buffers (runtime/llama/rows.py): so the spans are the same as before that change."""
from __future__ import annotations

import numpy as np
import pytest

from comfyui_a3b.runtime import SamplingParams

pytestmark = pytest.mark.slow


def plain_entropy(logits: np.ndarray) -> float:
    """The formula as it was: fresh arrays, one row at a time."""
    z = logits - logits.max()
    e = np.exp(z)
    s = e.sum()
    return float(np.log(s) - (e @ z) / s)


def four_slots_sampled_in_threads(rt, monkeypatch):
    """The embedded model with 4 slots, loaded afresh with its rows sampled in two threads (whatever
    the cores this process may use: a worker of a parallel test run has one)."""
    monkeypatch.setenv("A3B_SAMPLE_THREADS", "2")
    spec = rt.spec(n_parallel=4, n_ctx=256, speculative="off")
    rt.unload(spec)
    m = rt.load(spec)
    assert m.backend._pool is not None   # 4 slots and a 49k vocabulary: rows are sampled in threads
    return m


def decode_four_prompts(m) -> list[int]:
    """Four prompts decoded in one batch on sequences 0-3 of `m`'s context (the caller holds the
    model's lock); the batch index of each prompt's last token, whose logits row is there."""
    from comfyui_a3b.runtime.llama.binding import fill_batch, llama

    b = m.backend
    prompts = [m.tokenize(t, add_bos=True) for t in ("The sea is", "In 1492", "def add(a, b):", "Dear Sir,")]
    fill_batch(b.batch, ((t, p, s, p == len(toks) - 1) for s, toks in enumerate(prompts)
                         for p, t in enumerate(toks)))
    assert llama().llama_decode(b.ctx, b.batch) == 0
    return [int(e) for e in np.cumsum([len(t) for t in prompts]) - 1]


def test_rows_side_by_side_give_the_plain_formulas_entropies(rt, monkeypatch):
    from comfyui_a3b.runtime.llama.binding import llama
    from comfyui_a3b.runtime.llama.rows import entropy

    m = four_slots_sampled_in_threads(rt, monkeypatch)
    b = m.backend
    L = llama()
    with m._lock:                # the worker waits while the test drives its backend
        ends = decode_four_prompts(m)
        samplers = [b.new_sampler(SamplingParams(temperature=0.0, repeat_penalty=1.0), 0) for _ in range(4)]
        samplers += [b.new_sampler(SamplingParams(temperature=0.9, seed=7, repeat_penalty=1.0), 7) for _ in range(4)]
        rows = [(s, int(ends[i % 4]), True) for i, s in enumerate(samplers)]
        threaded = b.sample_rows(rows)
        pool, b._pool = b._pool, None
        try:
            serial = b.sample_rows(rows)
        finally:
            b._pool = pool
        logits = [np.ctypeslib.as_array(L.llama_get_logits_ith(b.ctx, int(i)), shape=(b.weights.n_vocab,)).copy()
                  for i in ends]
        for s in samplers:
            b.free_sampler(s)
        for s in range(4):
            b.trim(s, 0)
    plain = [plain_entropy(x) for x in logits]
    assert [e for _, e in threaded[:4]] == plain and [e for _, e in serial[:4]] == plain
    assert [t for t, _ in threaded[:4]] == [int(x.argmax()) for x in logits] == [t for t, _ in serial[:4]]
    assert [e for _, e in threaded[4:]] == plain and [entropy(x) for x in logits] == plain
    rt.unload(m.spec)
