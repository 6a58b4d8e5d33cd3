"""Where a request's tokens are drawn (runtime/local/sampler_choice.py): the policy, and the worker over the
fake engine attaching, moving and detaching backend chains (fast tier)."""
from __future__ import annotations

import pytest

from comfyui_a3b.runtime import Runtime, preset
from comfyui_a3b.runtime.generation import ConfidenceConfig, SamplingParams
from comfyui_a3b.runtime.requests import GenerationRequest
from comfyui_a3b.runtime.local.sampler_choice import BACKEND, CPU, choose

NO_CONF = ConfidenceConfig(enabled=False)
PLAIN = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.0, seed=3)


def _req(**kw) -> GenerationRequest:
    kw.setdefault("sampling", PLAIN)
    kw.setdefault("confidence", NO_CONF)
    return GenerationRequest("x", **kw)


def test_auto_leaves_greedy_and_temperature_chains_to_the_cpu_and_on_draws_them_in_the_graph():
    # both measured faster on the CPU, and a chain attached per request rebuilds llama.cpp's scheduler
    for sampling in (preset("greedy"), PLAIN):
        kind, why = choose("auto", True, _req(sampling=sampling))
        assert kind == CPU and "backend_sampling=on" in why
    assert choose("on", True, _req(sampling=preset("greedy"))) == (BACKEND, "greedy")
    assert choose("on", True, _req())[0] == BACKEND
    # spans are what auto draws in the graph, greedy or not, where the graph measures entropies
    spans = ConfidenceConfig(enabled=True)
    assert choose("auto", True, _req(sampling=preset("greedy"), confidence=spans), entropy=True)[0] == BACKEND
    assert choose("auto", True, _req(confidence=spans), entropy=True)[0] == BACKEND


@pytest.mark.parametrize("kw, why", [
    ({"sampling": SamplingParams(temperature=0.7, repeat_penalty=1.1)}, "repeat_penalty"),
    ({"json_schema": {"type": "object"}}, "grammar"),
    ({"grammar": 'root ::= "a"'}, "grammar"),
    ({"logprobs": 2}, "logprobs"),
    ({"confidence": ConfidenceConfig(enabled=True)}, "confidence"),
])
def test_what_the_backend_cannot_give_keeps_the_cpu_chain(kw, why):
    kind, reason = choose("on", True, _req(**kw))
    assert kind == CPU and why in reason


def test_only_a_load_with_matrix_products_on_the_cpu_is_probed_over_repacked_weights():
    from comfyui_a3b.runtime.llama.sampling_power import cpu_matmuls

    assert not cpu_matmuls(True, -1, 32, 0, False)     # everything offloaded ("all": -1)
    assert not cpu_matmuls(True, 33, 32, 0, False)
    assert cpu_matmuls(True, 32, 32, 0, False)          # the output layer stays on the CPU
    assert cpu_matmuls(True, 10, 32, 0, False) and cpu_matmuls(False, -1, 32, 0, False)
    assert cpu_matmuls(True, -1, 32, 4, False) and cpu_matmuls(True, -1, 32, 0, True)   # experts in RAM


def test_confidence_spans_go_to_the_backend_where_it_measures_entropies():
    conf = _req(confidence=ConfidenceConfig(enabled=True))
    assert choose("auto", True, conf, entropy=True)[0] == BACKEND   # a temperature chain too
    assert choose("auto", True, conf, entropy=False)[0] == CPU
    # the other reasons still hold with entropies in the graph
    kind, why = choose("auto", True, _req(confidence=ConfidenceConfig(enabled=True), logprobs=1), entropy=True)
    assert kind == CPU and why == "needs logprobs"


def test_a_request_drafting_more_than_the_load_allows_keeps_the_cpu_chain():
    # the context has draft_max + 1 output rows per sequence for backend chains
    assert choose("on", True, _req(draft_max=8), draft_max=8)[0] == BACKEND
    kind, why = choose("on", True, _req(draft_max=9), draft_max=8)
    assert kind == CPU and "draft_max" in why


def test_off_or_unavailable_is_the_cpu_chain():
    assert choose("off", True, _req()) == (CPU, "backend_sampling=off")
    assert choose("on", False, _req())[0] == CPU
    with pytest.raises(ValueError):
        choose("gpu", True, _req())


@pytest.fixture
def rt(fake_engine):
    r = Runtime()
    yield r
    r.unload()


def _run(rt, ref, mode, sampling, n=1, **kw):
    spec = rt.spec(ref, backend_sampling=mode, n_parallel=max(2, n), speculative="off")
    streams = [rt.submit(f"Hello {i}", model=spec, chat=False, max_tokens=12, sampling=sampling,
                         confidence=kw.get("confidence", NO_CONF)) for i in range(n)]
    return rt.load(spec), [s.result() for s in streams]


@pytest.mark.parametrize("sampling", [preset("greedy"), PLAIN], ids=["greedy", "sampled"])
def test_the_worker_attaches_a_chain_per_request_and_detaches_it_at_the_end(rt, sampling):
    m, on = _run(rt, "fake://m?backend_sampling=1", "on", sampling, n=3)
    _, off = _run(rt, "fake://m?backend_sampling=1", "off", sampling, n=3)
    assert [r.sampler for r in on] == [BACKEND] * 3 and [r.sampler for r in off] == [CPU] * 3
    assert [r.tokens for r in on] == [r.tokens for r in off]   # the fake draws the same either way
    assert len(m.backend.attaches) == 3 and m.backend.attached == {}
    assert m.stats["sampler_backend"] == 3


def test_every_output_row_is_prepared_with_where_it_draws(rt):
    """The worker tells the backend before each decode where each output row draws: a CPU row too,
    so that no chain left on its sequence (a parked one, attached.py) draws it instead."""
    m, res = _run(rt, "fake://m?backend_sampling=1", "off", PLAIN, n=2)
    assert [r.sampler for r in res] == [CPU, CPU]
    assert len(m.backend.prepares) == sum(len(r.tokens) for r in res)
    assert {b for _, b in m.backend.prepares} == {False}
    m, res = _run(rt, "fake://m?backend_sampling=1", "on", PLAIN, n=2)
    assert {b for _, b in m.backend.prepares} == {True}


def test_a_request_the_backend_cannot_draw_gets_no_chain(rt):
    pen = SamplingParams(temperature=0.7, repeat_penalty=1.2, seed=1)
    m, res = _run(rt, "fake://m?backend_sampling=1", "on", pen)
    assert res[0].sampler == CPU and m.backend.attaches == []
    m, res = _run(rt, "fake://m?backend_sampling=1", "on", PLAIN, confidence=ConfidenceConfig(enabled=True))
    assert res[0].sampler == CPU and m.backend.attaches == []


def test_an_engine_without_backend_chains_samples_on_the_cpu(rt):
    m, res = _run(rt, "fake://m", "on", PLAIN)
    assert res[0].sampler == CPU and m.backend.attaches == []


def test_confidence_spans_from_backend_chains_that_measure_entropies(rt):
    """An engine whose chains measure entropies draws a request with spans on the backend and gives
    the spans the CPU chain gives (the fake's entropies are the same either way)."""
    conf = ConfidenceConfig(enabled=True, threshold=1.0, min_run=1)
    m, on = _run(rt, "fake://m?backend_sampling=1&backend_entropy=1&text=ab1cd2ef", "auto", PLAIN, n=2,
                 confidence=conf)
    _, off = _run(rt, "fake://m?backend_sampling=1&backend_entropy=1&text=ab1cd2ef", "off", PLAIN, n=2,
                  confidence=conf)
    assert [r.sampler for r in on] == [BACKEND] * 2 and len(m.backend.attaches) == 2
    assert [r.entropies for r in on] == [r.entropies for r in off]
    assert [[s.as_dict() for s in r.spans] for r in on] == [[s.as_dict() for s in r.spans] for r in off]
    assert all(r.spans for r in on)
