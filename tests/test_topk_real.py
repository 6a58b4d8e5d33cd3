"""The CPU chain over a row's top-k candidates (runtime/llama/rows.py) on the real embedded model:
the same tokens as llama.cpp's llama_sampler_sample over the whole row, draw after draw, and the same
text end to end."""
from __future__ import annotations

import numpy as np
import pytest

from comfyui_a3b.runtime import SamplingParams
from comfyui_a3b.runtime.generation import ConfidenceConfig
from comfyui_a3b.runtime.llama import backend
from comfyui_a3b.runtime.llama.binding import llama

from test_entropy_real import decode_four_prompts, four_slots_sampled_in_threads

pytestmark = pytest.mark.slow
CHAINS = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0),
          SamplingParams(temperature=1.5, top_k=100, top_p=1.0, min_p=0.0, repeat_penalty=1.1),
          SamplingParams(temperature=0.7, top_k=40, repeat_penalty=1.0, ignore_eos=True),
          SamplingParams(temperature=0.7, top_k=40, repeat_penalty=1.0, samplers=["top_k", "top_p", "infill"]),
          SamplingParams(temperature=0.0, repeat_penalty=1.0, ignore_eos=True),
          SamplingParams(temperature=0.0, repeat_penalty=1.5),      # the penalty, then the likeliest
          SamplingParams(temperature=0.7, top_k=20, repeat_penalty=1.5, samplers=["penalties", "top_k", "temperature"])]


def test_candidates_draw_llama_cpps_tokens_on_real_rows(rt, monkeypatch):
    """Row by row and four rows at a time, against llama_sampler_sample over the whole row with
    the same chain."""
    m = four_slots_sampled_in_threads(rt, monkeypatch)
    b = m.backend
    submitted = []
    submit = b._pool.submit
    b._pool.submit = lambda fn, *a: submitted.append(fn.__name__) or submit(fn, *a)
    L = llama()
    with m._lock:                # the worker waits while the test drives its backend
        ends = decode_four_prompts(m)
        first = np.ctypeslib.as_array(L.llama_get_logits_ith(b.ctx, ends[0]), shape=(b.weights.n_vocab,))
        history = [int(t) for t in np.argsort(-first)[:60]]
        drawn = {"candidates": [], "row": []}
        for sp in CHAINS:
            for seed in range(12):
                fast = [b.new_sampler(sp, seed) for _ in ends]
                whole = [b.new_sampler(sp, seed) for _ in ends]
                for w in whole:      # llama_sampler_sample over the whole row
                    assert w.candidates > 0 or w.greedy
                    w.candidates, w.greedy = 0, False
                for x in fast + whole:   # a penalty on the likeliest tokens of the first row: what it
                    for t in history:    # lowers is out of the running, the answer further down
                        L.llama_sampler_accept(x.chain, t)
                for r in range(4):   # a chain's state (penalties, the random stream) moves on
                    if r % 2:
                        together = b.sample_rows([(f, e, False) for f, e in zip(fast, ends)])
                        drawn["candidates"] += [t for t, _ in together]
                    else:
                        drawn["candidates"] += [b.sample_rows([(f, e, False)])[0][0] for f, e in zip(fast, ends)]
                    drawn["row"] += [b.sample_rows([(w, e, False)])[0][0] for w, e in zip(whole, ends)]
                for s in fast + whole:
                    b.free_sampler(s)
        for s in range(4):
            b.trim(s, 0)
    b._pool.submit = submit
    assert drawn["candidates"] == drawn["row"]
    assert len(set(drawn["row"])) > 50      # the draws are spread, not one likeliest token
    assert submitted == []   # draws from candidates stay on the worker thread, four rows or one (rows.heavy)
    grammar = b.compile_grammar({"type": "object"}, None)
    constrained = b.new_sampler(CHAINS[0], 0, grammar=grammar)
    assert constrained.candidates == 0   # a grammar's matcher reads the whole row (and in the threads)
    b.free_sampler(constrained)
    rt.unload(m.spec)


def test_the_same_text_with_and_without_candidates(rt, monkeypatch):
    sp = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=11)
    spec = rt.spec(n_parallel=2, n_ctx=512, speculative="off", n_threads=2, backend_sampling="off")

    def run():
        return rt.submit("Once upon a time", model=spec, sampling=sp, max_tokens=96, chat=False,
                         confidence=ConfidenceConfig(enabled=False)).result()

    run()                                             # the prompt read once: both runs find it cached
    fast = run()
    monkeypatch.setattr(backend, "top_candidates", lambda logits, k, maxima=None: None)
    whole = run()
    assert fast.tokens == whole.tokens and len(fast.tokens) > 40
    rt.unload(spec)


def test_the_draw_benchmark_draws_the_same_tokens_both_ways():
    from comfyui_a3b.bench.bench_draw import CHAINS, measure

    rows = measure(49152, 30)   # raises where the two paths draw different tokens
    assert [r["chain"] for r in rows] == [name for name, _ in CHAINS]
    assert all(r["candidates"] > 0 and r["whole_row_ms"] > 0 and r["candidates_ms"] > 0 for r in rows)


def test_candidates_found_in_the_graph_draw_the_rows_tokens():
    """bench_graph_topk's alternative (a top-k chain of llama.cpp's in the graph, the CPU chain over
    its candidates) draws what the shipped pass over every row draws, step after step."""
    from comfyui_a3b.bench.bench_graph_topk import VARIANTS, measure

    rows = measure("default", 0, 3, 1, 48, counts=(1, 4))   # raises where the two differ
    assert [(r["sequences"], r["variant"]) for r in rows] == [(n, v) for n in (1, 4) for v in VARIANTS]
    assert all(r["step_ms"] > 0 and "tokens" not in r for r in rows)
