"""On the real embedded model and llama.cpp: a request cancelled while its prompt batch runs stops
that batch at once (llama.cpp's abort callback), and the model goes on serving correctly."""
from __future__ import annotations

import time

import pytest

from comfyui_a3b.runtime import preset

pytestmark = pytest.mark.slow

LONG = "The history of the lighthouse keepers of the northern coast, told in full detail. " * 90


def test_cancel_during_a_prompt_batch_stops_it(rt):
    spec = rt.spec(n_parallel=2, n_ctx=2048, n_batch=1024, speculative="off")   # one batch: ~1500 tokens
    greedy = preset("greedy")
    before = rt.generate("Say hello.", model=spec, max_tokens=8, sampling=greedy)
    m = rt.loaded(spec)
    t_batch = time.monotonic()
    full = rt.generate(LONG + " (a)", model=spec, chat=False, max_tokens=1, sampling=greedy)
    t_batch = time.monotonic() - t_batch            # what reading the long prompt takes here
    assert full.n_prompt_tokens > 1200
    # another beginning: the slot holding (a) shares no prefix with it, so the whole prompt is read
    read = m.stats["prompt_tokens"]
    stream = rt.submit("(b) " + LONG, model=spec, chat=False, max_tokens=8, sampling=greedy)
    deadline = time.monotonic() + 30
    while m.stats["prompt_tokens"] == read and time.monotonic() < deadline:   # placed: its batch starts
        time.sleep(0.005)
    time.sleep(min(0.2, t_batch / 5))
    aborted = m.stats["aborted_steps"]
    t0 = time.monotonic()
    stream.cancel()
    stream._done.wait(30)
    waited = time.monotonic() - t0
    assert stream.done and m.stats["aborted_steps"] == aborted + 1
    assert waited < max(0.5, t_batch / 2), (waited, t_batch)
    # the cache holds nothing of the stopped batch: the same prompts answer as before
    assert rt.generate("Say hello.", model=spec, max_tokens=8, sampling=greedy).text == before.text
    again = rt.generate(LONG + " (a)", model=spec, chat=False, max_tokens=1, sampling=greedy)
    assert again.text == full.text
    rt.unload(spec)
