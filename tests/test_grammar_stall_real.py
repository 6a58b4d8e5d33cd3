"""A hostile grammar request does not hold a concurrent short chat (slow tier, the real model).

With llama.cpp's grammar sampler a grammar of a few thousand alternatives made every token of its
request cost seconds, and a 4-token chat batched beside it waited for each (tens of seconds). Here
the chat beside such requests must end within a generous multiple of its time alone (plus slack
for a busy machine), and the hostile requests end too, with an answer or a clear error. Ratios,
measured: bench/bench_grammar_stall.py.
"""
from __future__ import annotations

import threading
import time

import pytest

from comfyui_a3b.runtime import InvalidRequest, Runtime, preset

pytestmark = pytest.mark.slow

ALTERNATIVES = "root ::= item+\nitem ::= " + " | ".join(f'"w{i}x"' for i in range(1500))
HOSTILE = [{"grammar": ALTERNATIVES}, {"json_schema": {"type": "string", "minLength": 100_000_000}},
           {"json_schema": {"type": "array", "minItems": 10_000_000, "items": {"type": "integer"}}}]


@pytest.mark.parametrize("hostile", HOSTILE, ids=["1500 alternatives", "minLength 1e8", "minItems 1e7"])
def test_a_hostile_grammar_does_not_hold_a_short_chat(hostile):
    rt = Runtime()
    spec = rt.spec(n_ctx=1024, n_parallel=2)
    greedy = preset("greedy")
    try:
        rt.generate("Hi", model=spec, max_tokens=4, sampling=greedy)   # warm
        t0 = time.perf_counter()
        rt.generate("Hi", model=spec, max_tokens=4, sampling=greedy)
        alone = time.perf_counter() - t0
        box: dict = {}

        def bad() -> None:
            try:
                box["result"] = rt.generate("Answer.", model=spec, max_tokens=64, sampling=greedy, **hostile)
            except InvalidRequest as e:
                box["error"] = e

        t = threading.Thread(target=bad)
        t.start()
        time.sleep(0.3)
        t0 = time.perf_counter()
        res = rt.generate("Hi", model=spec, max_tokens=4, sampling=greedy)
        beside = time.perf_counter() - t0
        t.join(120)
        assert not t.is_alive()
        assert res.n_tokens >= 1
        assert "result" in box or "error" in box
        assert beside < 10 * alone + 5.0, (beside, alone)
    finally:
        rt.unload()
