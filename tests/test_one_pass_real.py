"""On the real embedded model: after every slot was used and released out of order, a step that
decodes one token in each of several requests is still one pass through the model, counted by
llama.cpp's graph computes (runtime/slots.py, runtime/llama/passes.py)."""
from __future__ import annotations

import pytest

from comfyui_a3b.runtime import preset

pytestmark = pytest.mark.slow

PROMPTS = ["Name a colour.", "Write one word about the sea and nothing else, please.", "Count: 1, 2,",
           "A short greeting for a friend who lives far away from here:"]


def _run(rt, spec, lengths):
    sp = preset("greedy", ignore_eos=True)
    streams = [rt.submit(PROMPTS[i % 4] + f" ({n})", model=spec, max_tokens=n, sampling=sp)
               for i, n in enumerate(lengths)]
    return [s.result(120) for s in streams]


def test_decode_steps_stay_one_pass_after_slots_were_used_out_of_order(rt, monkeypatch):
    monkeypatch.setenv("A3B_COUNT_PASSES", "on")
    spec = rt.spec(n_parallel=4, n_ctx=320, speculative="off")   # a load of its own, with the counter
    m = rt.load(spec)
    try:
        counter = m.backend.passes
        assert counter is not None
        # warm-up: requests of different lengths end at different times, so the slots are released
        # (and reused by the next round) out of order; then a round of six over four slots
        _run(rt, spec, [3, 11, 6, 17])
        _run(rt, spec, [9, 2, 14, 5, 8, 12])
        warm = list(counter.per_step)
        counter.per_step.clear()
        results = _run(rt, spec, [24, 24, 24, 24])
        assert all(r.n_tokens == 24 for r in results)
        decoding = [p for tokens, seqs, p in counter.per_step if tokens == seqs and seqs > 1]
        assert len(decoding) >= 20, counter.per_step
        assert set(decoding) == {1}, counter.per_step
        # the counter counts: a step that reads a prompt beside decoding rows is two micro-batches
        # in llama.cpp's equal split (one token of each sequence, then the rest of the prompt)
        mixed = [p for tokens, seqs, p in warm if seqs > 1 and tokens > seqs]
        assert mixed and max(mixed) >= 2, warm
    finally:
        rt.unload(spec)
