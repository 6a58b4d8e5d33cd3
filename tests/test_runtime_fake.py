"""The runtime (store, worker, policy, streams) over the fake engine: the fast tier's core checks.

The fake engine (fakeengine.py) writes a known text and checks the worker's KV bookkeeping on every
decode, so these tests say exactly what a request must produce.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from comfyui_a3b.runtime import (PRIORITY_INTERACTIVE, Cancelled, ChatPrompt, ConfidenceConfig, InvalidRequest,
                                 ModelLoadFailed, ModelUnloaded, PromptTooLong, Runtime, preset)

GREEDY = preset("greedy")
NO_CONF = ConfidenceConfig(enabled=False)


@pytest.fixture
def rt(fake_engine):
    r = Runtime()
    yield r
    r.unload()


def wait_until(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_raw_generation_streams_the_models_text_and_ends_by_length(rt):
    stream = rt.submit("Hello", model="fake://m", chat=False, max_tokens=9, sampling=GREEDY)
    chunks = list(stream.text_chunks())
    res = stream.result()
    assert "".join(chunks) == res.text == "The quick"
    assert res.finish_reason == "length" and res.n_tokens == 9 and res.n_prompt_tokens == 6  # BOS + 5 bytes


def test_eos_ends_with_stop_and_stop_strings_are_never_streamed(rt):
    res = rt.generate("x", model="fake://m?eos_after=3", chat=False, max_tokens=50, sampling=GREEDY)
    assert res.text == "The" and res.finish_reason == "stop"
    seen = []
    res = rt.generate("x", model="fake://m", chat=False, max_tokens=50, sampling=GREEDY, stop=["brown"],
                      on_token=lambda ev: seen.append(ev.text))
    assert res.text == "The quick " and "".join(seen) == "The quick " and res.finish_reason == "stop"


def test_chat_prompt_uses_the_models_template(rt):
    m = rt.load("fake://m")
    prompt = ChatPrompt([{"role": "user", "content": "hi"}])
    text = m.render_chat(prompt)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    toks = m.prompt_tokens(prompt)
    assert toks[0] == m.vocab.bos and len(toks) == 1 + len(text.encode())
    assert rt.count_tokens(prompt, model="fake://m") == len(toks)
    # template variables are rendered into the model's own template; a named template takes none
    noted = ChatPrompt(prompt.messages, variables={"note": "N1"})
    assert m.render_chat(noted) == text + "N1"
    assert rt.generate(noted, model="fake://m", max_tokens=2).n_prompt_tokens == len(toks) + 2
    with pytest.raises(InvalidRequest, match="named template"):
        rt.generate(ChatPrompt(prompt.messages, template="chatml", variables={"note": "N1"}), model="fake://m")
    with pytest.raises(InvalidRequest, match="set by the runtime"):
        rt.generate(ChatPrompt(prompt.messages, variables={"messages": []}), model="fake://m")


def test_same_seed_same_text_and_seeds_differ(rt):
    def gen(seed):
        return rt.generate("x", model="fake://m", chat=False, max_tokens=30,
                           sampling=preset("creative", seed=seed)).text
    assert gen(1) == gen(1)
    assert len({gen(s) for s in (1, 2, 3)}) > 1


def test_shared_prefix_reuses_the_kv_cache(rt):
    spec = rt.spec("fake://m", n_parallel=1)
    prompt = "A long shared prefix of a prompt. " * 3
    first = rt.generate(prompt + "one", model=spec, chat=False, max_tokens=2, sampling=GREEDY)
    second = rt.generate(prompt + "two", model=spec, chat=False, max_tokens=2, sampling=GREEDY)
    assert first.n_cached_prompt_tokens == 0
    assert second.n_cached_prompt_tokens == 1 + len(prompt)
    assert rt.loaded(spec).stats["cached_prompt_tokens"] == second.n_cached_prompt_tokens


def test_cancel_between_tokens_keeps_the_text_so_far(rt):
    spec = rt.spec("fake://m?delay_ms=2")
    stream = rt.submit("x", model=spec, chat=False, max_tokens=500, sampling=GREEDY)
    n = 0
    for _ev in stream:
        n += 1
        if n == 5:
            stream.cancel()
    with pytest.raises(Cancelled) as ei:
        stream.result()
    partial = ei.value.partial
    assert 5 <= partial.n_tokens < 20 and partial.finish_reason == "cancelled"
    assert partial.text == ("The quick brown fox " * 2)[:len(partial.text)]
    # the model is clean for the next request
    assert rt.generate("x", model=spec, chat=False, max_tokens=3, sampling=GREEDY).text == "The"


def test_a_request_cancelled_while_waiting_never_takes_a_slot(rt):
    spec = rt.spec("fake://m?delay_ms=5", n_parallel=1)
    busy = rt.submit("x", model=spec, chat=False, max_tokens=40, sampling=GREEDY)
    waiting = rt.submit("y", model=spec, chat=False, max_tokens=40, sampling=GREEDY)
    waiting.cancel()
    with pytest.raises(Cancelled) as ei:
        waiting.result(10)
    assert ei.value.partial.n_tokens == 0
    assert busy.result(10).n_tokens == 40


def test_concurrent_requests_share_decode_steps(rt, fake_engine):
    spec = rt.spec("fake://m?delay_ms=1", n_parallel=4)
    streams = [rt.submit(f"prompt {i}", model=spec, chat=False, max_tokens=20, sampling=GREEDY) for i in range(4)]
    results = [s.result(10) for s in streams]
    assert all(r.text == "The quick brown fox " for r in results)
    backend = fake_engine.backends[-1]
    assert max(backend.batch_sizes) >= 2            # several sequences in one decode
    assert backend.decodes < 4 * 20                 # fewer decodes than tokens


def test_interactive_request_preempts_a_batch_generation_and_both_finish(rt):
    spec = rt.spec("fake://m?delay_ms=2", n_parallel=1)
    slow = rt.submit("batch job", model=spec, chat=False, max_tokens=60, sampling=GREEDY)
    wait_until(lambda: rt.loaded(spec).stats["generated_tokens"] >= 3, what="the batch job to start")
    fast = rt.submit("editor", model=spec, chat=False, max_tokens=5, sampling=GREEDY, priority=PRIORITY_INTERACTIVE)
    r_fast = fast.result(10)
    assert not slow.done                            # the editor request did not wait for the workflow
    r_slow = slow.result(10)
    assert r_fast.text == "The q" and r_slow.n_tokens == 60 and r_slow.text.startswith("The quick brown")
    assert rt.loaded(spec).stats["preempted"] >= 1


def test_confidence_spans_and_marker(rt):
    conf = ConfidenceConfig(threshold=1.0, min_run=2, insert_marker=True)
    res = rt.generate("x", model="fake://m?text=abc%0A12345%0Adef", chat=False, max_tokens=14,
                      sampling=GREEDY, confidence=conf)
    # entropy is high after a digit: the tokens following "1", "2", ... form one span
    assert len(res.spans) == 1 and res.spans[0].n_tokens >= 2
    assert conf.marker in res.text and res.text.index(conf.marker) < res.text.index("12345")


def test_unload_while_running_fails_cleanly_and_the_next_request_reloads(rt, fake_engine):
    spec = rt.spec("fake://m?delay_ms=2")
    m = rt.load(spec)
    stream = rt.submit("x", model=spec, chat=False, max_tokens=500, sampling=GREEDY)
    wait_until(lambda: m.stats["generated_tokens"] >= 3, what="generation")
    assert rt.unload(spec) == 1
    with pytest.raises(ModelUnloaded) as ei:
        stream.result(10)
    assert ei.value.partial.n_tokens >= 3
    assert m.closed.is_set() and fake_engine.backends[-1].closed and m.weights.freed
    loads = fake_engine.loads
    assert rt.generate("x", model=spec, chat=False, max_tokens=3, sampling=GREEDY).text == "The"
    assert fake_engine.loads == loads + 1


def test_unload_racing_generations_and_embeddings_never_breaks_a_request(rt):
    """Unloads from one thread while others generate and embed: every call either succeeds (after a
    reload) or fails with ModelUnloaded; nothing else, no hang."""
    spec = rt.spec("fake://race")
    errors: list[BaseException] = []
    ok = [0]
    stop = threading.Event()

    def work(i):
        while not stop.is_set():
            try:
                if i % 2:
                    rt.generate("x", model=spec, chat=False, max_tokens=3, sampling=GREEDY)
                else:
                    rt.embed(["a", "b", "c"], model=spec)
                ok[0] += 1
            except ModelUnloaded:
                pass
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for _ in range(40):
        rt.unload(spec)
        time.sleep(0.002)
    stop.set()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert not errors, errors[:3]
    assert ok[0] > 0


def test_embeddings_pool_normalize_and_match_across_calls(rt):
    v = rt.embed(["the cat sat", "the cat sat", "stock markets fell"], model="fake://m")
    assert v.shape == (3, 32) and np.allclose(np.linalg.norm(v, axis=1), 1.0)
    assert np.allclose(v[0], v[1]) and not np.allclose(v[0], v[2])
    raw = rt.embed(["the cat sat"], model="fake://m", normalize=False)
    assert not np.isclose(np.linalg.norm(raw), 1.0)


def test_an_interactive_generation_overtakes_a_long_embedding(rt):
    spec = rt.spec("fake://m?delay_ms=10", n_parallel=1)
    texts = [f"chunk number {i}" for i in range(40)]       # 40 texts: many packs
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("v", rt.embed(texts, model=spec)))
    t.start()
    m = rt.load(spec)
    wait_until(lambda: m.stats["embedded_texts"] > 0, what="embedding to start")
    t0 = time.perf_counter()
    res = rt.generate("x", model=spec, chat=False, max_tokens=3, sampling=GREEDY, priority=PRIORITY_INTERACTIVE)
    waited = time.perf_counter() - t0
    embedded_then = m.stats["embedded_texts"]
    t.join(30)
    assert res.text == "The" and box["v"].shape == (40, 32)
    assert embedded_then < 40, "the completion waited for the whole embedding"
    assert waited < 0.5


def test_cancelled_embedding_stops_between_packs(rt):
    spec = rt.spec("fake://m?delay_ms=10")
    flag = threading.Event()
    texts = [f"text {i}" for i in range(64)]
    m = rt.load(spec)
    threading.Timer(0.05, flag.set).start()
    with pytest.raises(Cancelled):
        rt.embed(texts, model=spec, cancelled=flag.is_set)
    assert m.stats["embedded_texts"] < 64
    assert rt.embed(["after"], model=spec).shape == (1, 32)    # the model still serves


def test_a_failed_decode_fails_its_requests_and_the_model_survives(rt):
    spec = rt.spec("fake://m?fail_decode=1")
    with pytest.raises(ModelLoadFailed, match="fake decode failure") as e:
        rt.generate("x", model=spec, chat=False, max_tokens=3, sampling=GREEDY)
    assert e.value.partial.finish_reason == "error" and e.value.partial.n_tokens == 0   # as every error carries
    assert rt.generate("x", model=spec, chat=False, max_tokens=3, sampling=GREEDY).text == "The"


def test_a_device_error_fails_the_step_closes_the_model_and_the_next_request_reloads(rt, fake_engine):
    spec = rt.spec("fake://m?fail_decode=1&fatal=1")
    first = rt.load(spec)
    loads = fake_engine.loads
    with pytest.raises(ModelLoadFailed, match="reloaded for the next request"):
        rt.generate("x", model=spec, chat=False, max_tokens=3, sampling=GREEDY)
    wait_until(lambda: first.closed.is_set(), what="the failed model to close")
    assert rt.generate("x", model=spec, chat=False, max_tokens=3, sampling=GREEDY).text == "The"
    assert fake_engine.loads == loads + 1 and rt.loaded(spec) is not first


def test_bad_requests_get_clear_errors(rt):
    spec = rt.spec("fake://m", n_ctx=32)
    with pytest.raises(PromptTooLong, match="context holds 32"):
        rt.generate("x" * 40, model=spec, chat=False)
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        rt.generate("   ", model=spec)
    with pytest.raises(InvalidRequest, match=r"temperature must be in \[0, 2\], got nan"):
        rt.generate("x", model=spec, sampling=preset("default", temperature=float("nan")))
    with pytest.raises(InvalidRequest, match="Token ids outside the vocabulary"):
        rt.generate(model=spec, prompt_tokens=[1, 99999], chat=False)
    with pytest.raises(InvalidRequest, match="not text"):
        rt.embed(["ok", 3], model=spec)        # type: ignore[list-item]
    with pytest.raises(PromptTooLong, match="embeddings take at most"):
        rt.embed(["y" * 300], model=spec)
    from comfyui_a3b.runtime.generation import MAX_STOP_CHARS, MAX_STOP_STRINGS

    with pytest.raises(InvalidRequest, match=f"at most {MAX_STOP_CHARS} in all"):
        rt.generate("x", model=spec, chat=False, stop=["q" * MAX_STOP_CHARS, "q"])
    with pytest.raises(InvalidRequest, match=f"At most {MAX_STOP_STRINGS} stop strings"):
        rt.generate("x", model=spec, chat=False, stop=[str(i) for i in range(MAX_STOP_STRINGS + 1)])


def test_memory_budget_evicts_the_least_recently_used_idle_model(fake_engine):
    rt = Runtime(budget_bytes=(1 << 20) * 2 + 300_000)
    try:
        a, b = rt.spec("fake://a"), rt.spec("fake://b")
        rt.load(a)
        rt.load(b)                      # does not fit beside a: a goes
        assert rt.loaded(a) is None and rt.loaded(b) is not None and rt.store.evictions == 1
    finally:
        rt.unload()


def test_status_reports_engine_neutral_model_facts(rt):
    rt.generate("x", model="fake://status", chat=False, max_tokens=2, sampling=GREEDY)
    st = rt.status()
    [m] = [m for m in st["models"] if m["name"] == "status"]
    assert m["engine"] == "fake" and m["architecture"] == "fake" and m["stats"]["generated_tokens"] == 2


def test_the_engine_seam_imports_no_engine_and_takes_only_engines():
    """engine.py names no engine (the runtime package sets the default one), so no import of it can
    come back to it; an object that is not an Engine is refused where it is registered."""
    import ast
    import inspect

    from comfyui_a3b.runtime import engine
    from comfyui_a3b.runtime.llama import local_engine

    tree = ast.parse(inspect.getsource(engine))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    assert not imported & {"llama", "remote", "worker", "store", "core"}, imported
    assert engine.engine_for("/some/model.gguf") is local_engine.ENGINE
    with pytest.raises(TypeError, match="subclass runtime.engine.Engine"):
        engine.register_engine("nope", object())


# -- stop strings ----------------------------------------------------------------------------------------
def _reference_assembler(stops: tuple[str, ...], pieces: list[str]) -> tuple[list[str], str, bool]:
    """Stop handling as a direct search writes it (quadratic, for short inputs): every stop string
    searched in the whole text, every prefix of every stop string tried as the held-back tail."""
    text, released, out = "", 0, []
    for p in pieces:
        text += p
        hits = [i for i in (text.find(s, max(0, released - len(s))) for s in stops) if i >= 0]
        if hits:
            text = text[:min(hits)]
            out.append(text[released:])
            return out, text, True
        hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        upto = max(released, len(text) - hold)
        out.append(text[released:upto])
        released = upto
    return out, text, False


def test_stop_strings_match_a_direct_search_on_random_text():
    import random

    from comfyui_a3b.runtime.generation import TextAssembler

    rng = random.Random(7)
    for _ in range(3000):
        alphabet = "ab" if rng.random() < 0.5 else "abc"
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7)))
                      for _ in range(rng.randint(1, 4)))
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 12))]
        want, want_text, want_stopped = _reference_assembler(stops, pieces)
        asm = TextAssembler(stops, NO_CONF)
        got = []
        for p in pieces:
            got.append(asm.add(p.encode(), None))
            if asm.stopped:
                break
        assert (got, asm.text, asm.stopped) == (want, want_text, want_stopped), (stops, pieces)


def test_text_given_after_a_stop_string_is_dropped():
    """A thinking model's answer assembler gets the splitter's held-back text after a stop string
    ended the answer: it is dropped, and the matcher is not advanced past its match."""
    from comfyui_a3b.runtime.generation import TextAssembler

    asm = TextAssembler(("STOP",), NO_CONF)
    assert asm.add_text("abST", 1.0) == "ab" and asm.add_text("OPcd", 1.0) == "" and asm.stopped
    assert asm.add_text("more", None) == "" and asm.add_text("", 0.5) == "" and asm.flush() == ""
    assert asm.text == "ab" and asm.final_text() == ("ab", [])


_LINEAR_STOP_SCRIPT = """
import time
from comfyui_a3b.runtime.generation import MAX_STOP_CHARS, ConfidenceConfig, TextAssembler

conf = ConfidenceConfig(enabled=False)

def run(stops, piece, n):
    asm = TextAssembler(stops, conf)
    t0 = time.perf_counter()
    released = "".join(asm.add(piece, None) for _ in range(n))
    return time.perf_counter() - t0, asm, released

n = 20000
base, _, _ = run(("qx",), b"qqqq", n)
worst = 0.0
for stop in ("q" * MAX_STOP_CHARS, "q" * (MAX_STOP_CHARS - 1) + "x", "qx" * (MAX_STOP_CHARS // 2)):
    dt, asm, released = run((stop,), b"qqqq", n)
    assert not asm.stopped and released + asm.flush() == "q" * 4 * n, stop[:4]
    assert len(released) == (4 * n - 1 if stop.startswith("qx") else 0)   # the rest is held back
    worst = max(worst, dt)
# a stop string at the bound, matched in full: the whole failure table is built once
t0 = time.perf_counter()
dt, asm, released = run(("q" * MAX_STOP_CHARS,), b"qqqq", MAX_STOP_CHARS // 4)
assert asm.stopped and asm.text == "" and released == ""
print(f"{base:.3f} {worst:.3f} {dt:.3f}")
"""


def test_a_stop_string_at_the_bound_costs_time_linear_in_the_text():
    """A 1 MiB stop string (the bound) makes a token cost what a short one does: the text is not
    searched again per token and no prefix of the stop string is copied (that took minutes per token)."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _LINEAR_STOP_SCRIPT], capture_output=True, text=True, timeout=180,
                       env=os.environ.copy())
    assert r.returncode == 0, r.stderr[-2000:]
    base, worst, full = map(float, r.stdout.split())
    # 20,000 tokens with a 2-character stop string take ~0.05 s; the same with a 1 MiB one must
    # stay within a small factor (an amortised constant per character); matching all 1 MiB (13 times
    # as many tokens) too.
    assert worst < 10 * base + 1.0, (base, worst)
    assert full < 30 * base + 1.0, (base, full)


def test_the_worker_counts_where_a_steps_time_goes(rt):
    """The parts a benchmark reads (bench_serving's step columns) nest: the launch, the wait for the
    engine and the sampling and streaming of the rows lie within the step; the fake's decode sleeps."""
    spec = rt.spec("fake://m?delay_ms=2")
    rt.generate("x", model=spec, chat=False, max_tokens=12, sampling=GREEDY)
    s = rt.loaded(spec).stats
    assert s["decode_calls"] >= 12 and s["decode_us"] >= 2000 * s["decode_calls"]
    assert s["step_us"] >= s["decode_us"] + s["wait_us"] + s["verify_us"]
    assert 0 < s["sample_us"] <= s["verify_us"]


def test_a_prompt_chunk_alone_is_not_waited_for(rt, monkeypatch):
    """A step that only reads a prompt chunk has no row to sample: the worker does not wait for the
    engine to finish it (a GPU computes it while the next chunk is launched); it waits once per step
    with output rows."""
    from fakeengine import FakeBackend

    waits = []
    monkeypatch.setattr(FakeBackend, "synchronize", lambda self: waits.append(1), raising=False)
    spec = rt.spec("fake://m?speculative=off", n_batch=32)
    res = rt.generate("x" * 200, model=spec, chat=False, max_tokens=3, sampling=GREEDY)
    s = rt.loaded(spec).stats
    assert res.n_tokens == 3 and s["decode_calls"] >= 9    # 201 prompt tokens in chunks of 32, then 2
    assert len(waits) == 3
