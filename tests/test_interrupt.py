"""A request cancelled while its prompt is read stops that batch at once (Backend.interrupt); the
other requests of the step take it again and lose nothing (fast tier, the fake engine)."""
from __future__ import annotations

import threading
import time

from comfyui_a3b.runtime import preset

# every step 20 ms, a step that reads a prompt chunk 3 s: a long prompt batch on a busy CPU
MODEL = "fake://slowprompt?delay_ms=20&prompt_factor=150"


def test_cancel_while_the_prompt_is_read_ends_within_half_a_second(rt, fake_engine):
    spec = rt.spec(MODEL, n_parallel=2, n_ctx=256, speculative="off")
    rt.load(spec)
    stream = rt.submit("a" * 100, model=spec, chat=False, max_tokens=8, sampling=preset("greedy"))
    time.sleep(0.3)                     # the prompt batch is running now
    t0 = time.monotonic()
    stream.cancel()
    stream._done.wait(5)
    assert stream.done and time.monotonic() - t0 < 0.5
    assert rt.loaded(spec).stats["aborted_steps"] == 1
    rt.unload(spec)


def test_the_others_in_the_stopped_step_lose_nothing(rt, fake_engine):
    spec = rt.spec(MODEL, n_parallel=2, n_ctx=256, speculative="off")
    rt.load(spec)
    greedy = preset("greedy")
    other = rt.submit("b" * 50, model=spec, chat=False, max_tokens=30, sampling=greedy)
    time.sleep(3.5)                     # its prompt is read; it decodes now
    doomed = rt.submit("a" * 100, model=spec, chat=False, max_tokens=8, sampling=greedy)
    time.sleep(0.4)                     # the step reading doomed's prompt holds other's token too
    doomed.cancel()
    res = other.result(30)
    alone = rt.generate("b" * 50, model=spec, chat=False, max_tokens=30, sampling=greedy)
    assert res.text == alone.text and res.n_tokens == 30
    assert rt.loaded(spec).stats["aborted_steps"] >= 1
    rt.unload(spec)


def test_a_cancel_between_steps_of_single_tokens_does_not_stop_the_others_step(rt, fake_engine):
    spec = rt.spec("fake://steady?delay_ms=30", n_parallel=2, n_ctx=256, speculative="off")
    rt.load(spec)
    greedy = preset("greedy")
    a = rt.submit("x", model=spec, chat=False, max_tokens=40, sampling=greedy)
    b = rt.submit("y", model=spec, chat=False, max_tokens=40, sampling=greedy)
    time.sleep(0.3)
    done = threading.Event()
    b.add_done_callback(lambda s: done.set())
    b.cancel()
    assert done.wait(2) and a.result(30).n_tokens == 40
    assert rt.loaded(spec).stats["aborted_steps"] == 0   # a step of one token each just ends
    rt.unload(spec)
