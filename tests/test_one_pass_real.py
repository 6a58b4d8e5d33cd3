"""On the real embedded model: after every slot was used and released out of order, a step that
decodes one token in each of several requests is still one pass through the model, counted by
llama.cpp's graph computes (runtime/local/slots.py, runtime/llama/passes.py)."""
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


def test_the_equal_split_the_drafting_rule_counts_is_llamas(rt, monkeypatch):
    """slots.passes (what drafting.even weighs drafts with) against llama.cpp's own count: batches
    whose sequences put in different numbers of tokens, decoded by the real backend."""
    from comfyui_a3b.runtime.local.scheduler import Job, Slot
    from comfyui_a3b.runtime.local.slots import passes
    from comfyui_a3b.runtime.local.steps import DecodeStep, Entry

    monkeypatch.setenv("A3B_COUNT_PASSES", "on")
    spec = rt.spec(n_parallel=4, n_ctx=256, speculative="off")
    m = rt.load(spec)
    try:
        backend = m.backend
        for shape in ([1, 5, 1], [1, 5, 1, 5], [4, 4, 4], [5, 5, 4, 5], [1, 1, 1, 1], [3, 1, 2]):
            entries = []
            for seq_id, n in enumerate(shape):
                backend.trim(seq_id, 0)
                job = Job([300 + 17 * seq_id + k for k in range(n)])
                job.slot = Slot(seq_id)
                entries.append(Entry(job, 0, n, output=0))
            step = DecodeStep(entries)
            step.number_rows()
            backend.decode(step)
            counted = backend.passes.per_step[-1][2]
            assert counted == passes(list(enumerate(shape))), (shape, counted)
    finally:
        rt.unload(spec)
