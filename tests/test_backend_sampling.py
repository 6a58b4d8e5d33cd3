"""Backend sampling on the real embedded model (slow tier): greedy gives the CPU chain's tokens,
a seed gives the same text run to run, the draws follow the model's distribution, confidence spans
measured in the graph are the CPU's, and requests the graph cannot draw fall back to the CPU chain.
The weights are loaded unrepacked (A3B_CPU_REPACK=off): over this processor's AMX-repacked weights
llama.cpp's backend chains crash (the probe in the vetting child finds that and keeps the CPU chain)."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from comfyui_a3b.runtime import Runtime, preset
from comfyui_a3b.runtime.generation import ConfidenceConfig, SamplingParams

from test_speculative_model import _rewrite_prompt

pytestmark = pytest.mark.slow
OFF = ConfidenceConfig(enabled=False)
PROMPT = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def rt():
    mp = pytest.MonkeyPatch()
    mp.setenv("A3B_CPU_REPACK", "off")
    r = Runtime()
    yield r
    r.unload()
    mp.undo()


def _gen(rt, mode, sampling, max_tokens=40, speculative="off", prompt=PROMPT, **kw):
    spec = rt.spec(None, backend_sampling=mode, n_parallel=2, speculative=speculative)
    return rt.submit(prompt, model=spec, sampling=sampling, max_tokens=max_tokens,
                     confidence=kw.pop("confidence", OFF), **kw).result()


def test_greedy_through_the_backend_gives_the_cpu_chains_tokens(rt):
    cpu, backend = _gen(rt, "off", preset("greedy")), _gen(rt, "on", preset("greedy"))
    assert (cpu.sampler, backend.sampler) == ("cpu", "backend")
    assert backend.tokens == cpu.tokens and len(cpu.tokens) > 20


def test_a_seed_gives_the_same_text_run_to_run(rt):
    sp = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=11)
    a, b = _gen(rt, "on", sp), _gen(rt, "on", sp)
    assert a.sampler == "backend" and a.tokens == b.tokens
    other = _gen(rt, "on", SamplingParams(**{**sp.__dict__, "seed": 12}))
    assert other.tokens != a.tokens


def test_penalties_grammar_and_logprobs_fall_back_to_the_cpu_chain(rt):
    pen = SamplingParams(temperature=0.7, repeat_penalty=1.1, seed=1)
    assert _gen(rt, "on", pen, max_tokens=8).sampler == "cpu"
    assert _gen(rt, "auto", preset("greedy"), max_tokens=8, logprobs=2).sampler == "cpu"
    r = _gen(rt, "auto", preset("greedy"), max_tokens=8, json_schema={"type": "object"})
    assert r.sampler == "cpu" and r.text.lstrip().startswith("{")


@pytest.mark.parametrize("sampling", [preset("greedy"), SamplingParams(temperature=0.8, top_k=40, top_p=0.95,
                                                                       min_p=0.05, repeat_penalty=1.0, seed=3)],
                         ids=["greedy", "t0.8"])
def test_confidence_spans_measured_in_the_graph_are_the_cpu_chains(rt, sampling):
    """A request with confidence spans draws on the backend, its entropies measured in the graph
    (llama/graph_entropy.py): the same tokens, entropies within float32 rounding and the same spans
    as the CPU chain, which reads each raw row (a fixed seed; both chains draw the same tokens)."""
    conf = ConfidenceConfig(threshold=1.5, min_run=1)
    cpu = _gen(rt, "off", sampling, max_tokens=48, confidence=conf)
    graph = _gen(rt, "auto", sampling, max_tokens=48, confidence=conf)
    assert (cpu.sampler, graph.sampler) == ("cpu", "backend")
    assert graph.tokens == cpu.tokens and len(cpu.tokens) > 20
    assert np.allclose(graph.entropies, cpu.entropies, rtol=1e-4, atol=1e-4), (graph.entropies, cpu.entropies)
    assert [s.as_dict() | {"mean_entropy": 0, "max_entropy": 0} for s in graph.spans] == \
        [s.as_dict() | {"mean_entropy": 0, "max_entropy": 0} for s in cpu.spans]
    assert cpu.spans, "no span to compare: a lower threshold is needed"


def test_backend_draws_follow_the_models_distribution(rt):
    """The first answer token drawn N times with different seeds at temperature 1 against the softmax
    of the raw logits (the CPU path's logprobs): a chi-square test over the likeliest tokens."""
    sp = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    m = rt.load(rt.spec(None, backend_sampling="on", n_parallel=2, speculative="off"))
    n = 300
    counts = collections.Counter(_gen(rt, "on", SamplingParams(**sp, seed=s), max_tokens=1).tokens[0]
                                 for s in range(n))
    stream = rt.submit(PROMPT, model=rt.spec(None, backend_sampling="off", n_parallel=2, speculative="off"),
                       sampling=SamplingParams(**sp, seed=0), max_tokens=1, confidence=OFF, logprobs=20)
    ev = [e for e in stream if e.top_logprobs][0]
    stream.result()
    probs = {m.vocab.tokenize(text, add_bos=False, special=False)[0]: float(np.exp(lp))
             for text, lp in ev.top_logprobs if len(m.vocab.tokenize(text, add_bos=False, special=False)) == 1}
    keep = [t for t, p in probs.items() if p * n >= 5]
    assert len(keep) >= 2, probs
    observed = [counts[t] for t in keep] + [n - sum(counts[t] for t in keep)]
    expected = [probs[t] * n for t in keep] + [n * (1 - sum(probs[t] for t in keep))]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    # 99.9% quantile of chi-square with len(keep) degrees of freedom, bounded above by 3*df + 12
    assert chi2 < 3 * len(keep) + 12, (chi2, observed, expected)


#: a function to copy with one name changed (raw, no chat template): n-gram lookup drafts most of it
REPEAT = _rewrite_prompt()


def test_ngram_drafts_checked_by_backend_draws_give_the_same_tokens(rt):
    """Drafted tokens are accepted while the graph's draw at their row equals them: greedy with n-gram
    lookup and backend chains gives the tokens of plain decoding with the CPU chain."""
    plain = _gen(rt, "off", preset("greedy"), max_tokens=160, prompt=REPEAT, chat=False)
    spec = _gen(rt, "on", preset("greedy"), max_tokens=160, speculative="ngram", prompt=REPEAT, chat=False)
    assert (plain.sampler, spec.sampler) == ("cpu", "backend")
    assert spec.n_accepted_tokens > 10, (spec.n_drafted_tokens, spec.n_accepted_tokens)
    assert spec.tokens == plain.tokens and len(plain.tokens) > 100


def test_a_seeded_chain_with_ngram_drafts_is_reproducible(rt, draft_cost_at_prior):
    """Run to run while the steps are the same: a step of another shape, or on another number of
    threads, can move the last bits of the logits and so a sampled token (the README's limits say
    so). How many tokens a request drafts follows the step times the model measured
    (speculative.StepCost), and the thread tuner picks counts by time too; both move from run to run
    on a busy machine, so the threads are fixed and the cost model held at its prior here: then the
    runs after the first (which reads the whole prompt) draft alike and give the same text."""
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, seed=5)
    spec = rt.spec(None, backend_sampling="on", n_parallel=2, speculative="ngram", n_threads=2)

    def run():
        return rt.submit(REPEAT, model=spec, sampling=sp, max_tokens=160, confidence=OFF, chat=False).result()

    run()
    a, b = run(), run()
    assert a.sampler == "backend" and a.n_drafted_tokens > 0
    assert a.tokens == b.tokens and len(a.tokens) > 20


def test_a_request_drafting_more_than_the_load_allows_keeps_the_cpu_chain(rt, draft_cost_at_prior):
    """The context has draft_max + 1 output rows per sequence with a backend chain; llama.cpp
    refuses a batch with more (decode -1), so a request asking more drafts samples on the CPU."""
    plain = _gen(rt, "off", preset("greedy"), max_tokens=160, prompt=REPEAT, chat=False)
    more = _gen(rt, "on", preset("greedy"), max_tokens=160, speculative="ngram", prompt=REPEAT, chat=False,
                draft_max=16)
    assert more.sampler == "cpu" and more.tokens == plain.tokens and more.n_drafted_tokens > 0


def test_a_finished_requests_chain_serves_the_next_request_like_it_and_leaves_for_a_cpu_row(rt):
    """The chain of the request that finished last stays on its sequence (attached.py: attaching one
    rebuilds llama.cpp's scheduler): the next request there with the same settings and seed takes it
    over and draws what a fresh chain of that seed draws; a CPU-sampled request placed there gets its
    row's logits, not a token drawn by the parked chain."""
    spans = ConfidenceConfig(threshold=1.5, min_run=1)
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, seed=7)
    spec = rt.spec(None, backend_sampling="auto", n_parallel=1, speculative="off", n_threads=2)
    chains = rt.load(spec).backend.chains

    def run(**kw):
        kw.setdefault("sampling", sp)
        kw.setdefault("confidence", spans)
        return rt.submit(PROMPT, model=spec, max_tokens=32, **kw).result()

    greedy_first = run(sampling=preset("greedy"), confidence=OFF, logprobs=1)   # nothing attached yet
    run()
    parked = chains.parked
    assert parked is not None and parked.chain and chains.by_seq[0] is parked
    taken = run()
    assert chains.parked is parked and chains.by_seq[0] is parked   # taken over, parked again
    greedy = run(sampling=preset("greedy"), confidence=OFF, logprobs=1)
    assert greedy.sampler == "cpu" and greedy.tokens == greedy_first.tokens
    assert chains.parked is None and 0 not in chains.by_seq and parked.chain is None
    fresh = run()
    assert chains.parked is not parked
    assert (taken.sampler, fresh.sampler) == ("backend", "backend")
    assert taken.tokens == fresh.tokens and taken.entropies == pytest.approx(fresh.entropies, abs=1e-4)


def test_one_chain_at_most_stays_parked(rt):
    """Requests that land on other sequences (prompts that share little take the least recently used
    slot) leave one parked chain, not one per sequence."""
    spans = ConfidenceConfig(threshold=1.5, min_run=1)
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, seed=3)
    spec = rt.spec(None, backend_sampling="auto", n_parallel=4, speculative="off")
    chains = rt.load(spec).backend.chains
    seqs = set()
    for i in range(6):
        word = ("Apples", "Rivers", "Seven", "Quietly", "Mountains", "Yesterday")[i]
        r = rt.submit(f"{word} are the subject of this short note, number {i}:", model=spec, chat=False,
                      sampling=sp, max_tokens=6, confidence=spans).result()
        assert r.sampler == "backend"
        seqs.add(chains.parked.seq_id)
        assert list(chains.by_seq.values()) == [chains.parked]
    assert len(seqs) > 1   # the requests did land on several sequences
