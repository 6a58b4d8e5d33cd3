"""Speculative decoding, fast tier: the drafter, the K policy, the scheduler's batch room for drafts,
the acceptance rule, and the worker over the fake engine (its KV bookkeeping checks every trim)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from comfyui_a3b.runtime import InvalidRequest, Runtime, preset
from comfyui_a3b.runtime.generation import ConfidenceConfig
from comfyui_a3b.runtime.options import LoadSpec
from comfyui_a3b.runtime.generation import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from comfyui_a3b.runtime.local.scheduler import Job, Policy, Trim
from comfyui_a3b.runtime.local.speculative import (NgramDrafter, SpecControl, StepCost, accept_drafts, best_k, check_k,
                                             parse_mode)

GREEDY = preset("greedy")


class DJob(Job):
    """A job that asks for a fixed draft room."""

    def __init__(self, tokens, prio=PRIORITY_BATCH, room=4):
        super().__init__(list(tokens), prio)
        self.room = room

    def draft_room(self, rows: int = 1) -> int:
        return self.room


# -- the drafter and the K policy ------------------------------------------------------------------------------
def test_ngram_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    d = NgramDrafter(sizes=(3, 2))
    d.extend([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2])
    # last 2-gram (1, 2) was last followed by 3, 7, 8 (the latest occurrence wins)
    assert d.propose(3) == [3, 7, 8]
    d.extend(d.seq + [3])   # now the 3-gram (1, 2, 3): latest at position 9
    assert d.propose(5) == [7, 8, 6, 1, 2]
    assert d.propose(0) == []
    e = NgramDrafter()
    e.extend([5, 6, 7, 8])
    assert e.propose(4) == []   # nothing repeats


def test_ngram_index_grows_linearly():
    d = NgramDrafter()
    seq = list(range(1000)) * 3
    for n in range(1, len(seq), 97):
        d.extend(seq[:n])
    d.extend(seq)
    assert len(d.index) <= 3 * 1000 + 10   # one entry per distinct n-gram
    assert d.propose(4) == [0, 1, 2, 3] or len(d.propose(4)) == 4


def test_k_follows_acceptance_and_step_cost_and_pauses_when_no_k_pays():
    assert best_k(0.0, 0.1, 8) == 0
    assert best_k(1.0, 0.05, 8) == 8            # a GPU: an extra token costs 5% of a step
    assert best_k(0.8, 0.05, 16) > best_k(0.8, 0.5, 16) >= 1   # a CPU: fewer
    assert best_k(0.9, 1.2, 8) == 0             # an extra token costs more than a step: never
    cost = StepCost()
    for _ in range(50):
        cost.record(2, 2, 0.010)                # two sequences, one token each: 10 ms
        cost.record(10, 2, 0.030)               # eight more tokens: 20 ms more
    assert abs(cost.extra_at(2) - 0.5) < 0.01   # 2.5 ms a token against each one's 5 ms share
    assert abs(cost.extra - 0.5) < 0.01         # one sequence alone: estimated from two (5 ms)
    cost.record(1, 1, 1e-5)                     # too short to tell: not counted
    cost.record(10, 2, 2.0)                     # a step that built its graph: an outlier, not the cost
    assert abs(cost.extra_at(2) - 0.5) < 0.01
    for _ in range(50):
        cost.record(1, 1, 0.010)                # measured alone: 10 ms
    assert abs(cost.extra - 0.25) < 0.01
    c = SpecControl(8, cost, accept=0.8)
    k0 = c.room()
    for _ in range(10):
        c.record(c.room(), c.room(), c.room() + 1)
    assert c.room() > k0 and c.rate > 0.95      # every draft accepted: longer drafts
    for _ in range(10):
        if c.room() == 0:
            break
        c.record(c.room(), 0, 1)
    assert c.room() == 0 and c.paused_for == SpecControl.PAUSE   # nothing accepted: paused
    c.record(0, 0, SpecControl.PAUSE)           # tokens generated without drafting end the pause
    assert c.room() == 1                        # then one token is tried
    c.record(1, 0, 1)
    assert c.room() == 0 and c.paused_for == 2 * SpecControl.PAUSE   # the next pause is longer


def test_drafts_are_judged_against_a_requests_share_of_the_step():
    """On a CPU a step of four sequences costs about four single ones: a drafted token then costs a
    whole share and nothing but near-certain drafts pay; on a GPU a step barely grows with its rows
    and drafting pays at sixteen requests too."""
    cpu = StepCost()
    for _ in range(20):
        cpu.record(1, 1, 0.010)
        cpu.record(4, 4, 0.036)
        cpu.record(2, 1, 0.019)                 # one drafted token: 9 ms, a row's share at four
    assert best_k(0.95, cpu.extra_at(1), 8) >= 1           # alone, a near-certain draft pays
    assert cpu.extra_at(4) > 0.95 and best_k(0.95, cpu.extra_at(4), 8) == 0   # at four it does not
    c = SpecControl(8, cpu, accept=0.95)
    assert c.room(1) >= 1 and c.room(4) == 0
    gpu = StepCost()
    for _ in range(20):
        gpu.record(1, 1, 0.0085)
        gpu.record(16, 16, 0.0090)
        gpu.record(17, 16, 0.0091)              # an extra token: 0.1 ms
    assert gpu.extra_at(16) < 0.25 and best_k(0.8, gpu.extra_at(16), 8) >= 2


def test_bad_speculative_settings_are_clear_errors():
    assert parse_mode("draft:small.gguf") == ("draft", "small.gguf")
    assert parse_mode("NGRAM") == ("ngram", None)
    for bad in ("fast", "draft", "draft:", "ngram:3", 5):
        with pytest.raises(InvalidRequest, match="speculative"):
            parse_mode(bad)
    for bad in (0, -1, math.nan, 1.5, True, "4"):
        with pytest.raises(InvalidRequest, match="draft_max"):
            check_k(bad)
    with pytest.raises(InvalidRequest, match="speculative"):
        LoadSpec("m.gguf", speculative="sometimes").validate()
    for bad in (0, math.nan):
        with pytest.raises(InvalidRequest, match="draft_max"):
            LoadSpec("m.gguf", draft_max=bad).validate()


# -- the policy: batch room for drafts ----------------------------------------------------------------------------
def placed(p: Policy, *jobs: Job) -> None:
    for j in jobs:
        p.submit(j)
    p.admit()


def decoding(p: Policy, j: Job) -> None:
    """Bring `j` to decoding: its prompt read, one sampled token not yet fed."""
    j.fed = len(j.seq)
    j.slot.tokens = list(j.seq)
    j.seq.append(7)


def test_drafts_take_only_the_room_left_after_every_jobs_share():
    p = Policy(n_slots=3, batch_tokens=10)
    a, b, c = DJob([1, 2], room=8), DJob([3, 4], room=8), DJob(range(20, 40), room=8)
    placed(p, a, b, c)
    decoding(p, a)
    decoding(p, b)
    step = p.next_step()
    by = {e.job: e for e in step.entries}
    # a and b decode one token each, c's prompt takes what is left: nothing for drafts
    assert by[a].count == by[b].count == 1 and by[c].count == 8
    assert by[a].room == by[b].room == 0
    p2 = Policy(n_slots=2, batch_tokens=10)
    a2, b2 = DJob([1, 2], room=8), DJob([3, 4], room=8)
    placed(p2, a2, b2)
    decoding(p2, a2)
    decoding(p2, b2)
    step = p2.next_step()
    rooms = [e.room for e in step.entries]
    assert sum(rooms) == 8 and rooms == [8, 0]   # the oldest first, within the budget


def test_interactive_jobs_draft_first_and_riders_beside_editors_draft_nothing():
    clock = [0.0]
    p = Policy(n_slots=2, batch_tokens=64, clock=lambda: clock[0])
    batch = DJob([1, 2], room=8)
    placed(p, batch)
    decoding(p, batch)
    clock[0] = 20.0   # the batch job has waited: promoted, it rides beside editors
    ed = DJob([3, 4], PRIORITY_INTERACTIVE, room=8)
    placed(p, ed)
    decoding(p, ed)
    step = p.next_step()
    by = {e.job: e for e in step.entries}
    assert batch.promoted and by[batch].count == 1 and by[batch].room == 0
    assert by[ed].room == 8


def test_batch_work_drafts_one_small_pack_while_editors_are_active():
    clock = [0.0]
    p = Policy(n_slots=4, batch_tokens=256, yield_tokens=16, clock=lambda: clock[0])
    ed = Job([9, 9], PRIORITY_INTERACTIVE)
    p.submit(ed)
    p.admit()
    p.release(ed)   # the editor went; its window stays open
    jobs = [DJob([i, i + 1], room=12) for i in range(3)]
    placed(p, *jobs)
    for j in jobs:
        decoding(p, j)
    step = p.next_step()
    assert sum(e.room for e in step.entries) == 16
    clock[0] = 100.0   # editors gone: the whole budget is there
    step = p.next_step()
    assert sum(e.room for e in step.entries) == 36


def test_settle_keeps_accepted_drafts_and_trims_the_rest():
    p = Policy(n_slots=1, batch_tokens=64)
    j = DJob([1, 2, 3], room=4)
    placed(p, j)
    decoding(p, j)          # fed 3, seq [1, 2, 3, 7]
    step = p.next_step()
    e = step.entries[0]
    e.draft = [5, 6, 8, 9]
    step.number_rows()
    assert e.output == 0 and step.n_tokens == 5
    p.decoded(step)
    assert j.slot.tokens == [1, 2, 3, 7, 5, 6, 8, 9] and j.fed == 4
    j.seq += [5, 6, 4]      # two drafts accepted, then the model's own token
    assert p.settle(j, j.slot, 2) == Trim(0, 6)
    assert j.slot.tokens == [1, 2, 3, 7, 5, 6] and j.fed == 6 and j.remaining == 1
    slot = j.slot
    p.release(j)
    assert p.settle(j, slot, 2) is None   # finished meanwhile: its cache stays as decoded


# -- the acceptance rule, statistically -----------------------------------------------------------------------
def test_speculative_sampling_follows_the_target_distribution():
    """Drafts drawn from q, judged against p: the tokens out follow p (first and second position),
    within a chi-square bound that a draw from q on rejection (the usual mistake) fails by far."""
    rng = np.random.default_rng(7)
    V, N = 5, 40000
    p = np.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.2, 0.3, 0.3], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = np.array([[0.1, 0.1, 0.1, 0.2, 0.5], [0.6, 0.1, 0.1, 0.1, 0.1]])
    first = np.zeros(V)
    second = np.zeros(V)
    n_second = 0
    accepted = 0
    for _ in range(N):
        d0 = rng.choice(V, p=q[0])
        d1 = rng.choice(V, p=q[1])
        out = accept_drafts(p, q, [d0, d1], rng)
        first[out[0]] += 1
        if len(out) > 1:
            # the second token's distribution is p's second row only when the first was the draft
            second[out[1]] += 1
            n_second += 1
        accepted += len(out) - 1
    def chi2(counts, probs):
        n = counts.sum()
        return float(((counts - n * probs) ** 2 / (n * probs)).sum())
    # 4 degrees of freedom: P(chi2 > 20) < 0.001
    assert chi2(first, p[0]) < 20
    assert chi2(second, p[1]) < 20
    expected_accept = np.minimum(p[0], q[0]).sum()   # the acceptance rate of the first draft
    assert abs(n_second / N - expected_accept) < 0.02
    assert 0 < accepted


def test_a_wrong_residual_fails_the_same_check():
    """The check above can fail: drawing from p itself on rejection (not the residual) skews the output."""
    rng = np.random.default_rng(3)
    p = np.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.2] * 5])
    q = np.array([[0.1, 0.1, 0.1, 0.2, 0.5]])
    counts = np.zeros(5)
    for _ in range(20000):
        d = rng.choice(5, p=q[0])
        if rng.random() < min(1.0, p[0, d] / q[0, d]):
            counts[d] += 1
        else:
            counts[rng.choice(5, p=p[0])] += 1
    n = counts.sum()
    assert float(((counts - n * p[0]) ** 2 / (n * p[0])).sum()) > 20


# -- the worker over the fake engine --------------------------------------------------------------------------
@pytest.fixture
def rt(fake_engine):
    r = Runtime()
    yield r
    r.unload()


def run(rt, model, spec, **kw):
    kw.setdefault("sampling", GREEDY)
    return rt.submit(kw.pop("prompt", "Hello"), model=rt.spec(model, speculative=spec), chat=False, **kw).result()


def test_greedy_text_is_the_same_with_and_without_speculation_in_fewer_decodes(rt, fake_engine):
    plain = run(rt, "fake://a", "off", max_tokens=120)
    n_plain = fake_engine.decodes["fake://a"]
    spec = run(rt, "fake://b", "ngram", max_tokens=120)
    n_spec = fake_engine.decodes["fake://b"]
    assert spec.tokens == plain.tokens and spec.text == plain.text and spec.finish_reason == "length"
    assert plain.n_drafted_tokens == 0
    assert spec.n_drafted_tokens > 0 and spec.n_accepted_tokens > 0.8 * spec.n_drafted_tokens
    assert n_spec < n_plain / 2
    stats = rt.status()["models"]
    by = {m["path"]: m for m in stats}
    assert by["fake://b"]["stats"]["accepted_tokens"] == spec.n_accepted_tokens
    assert by["fake://b"]["spec"]["speculative"] == "ngram"


def test_sampled_text_is_the_same_draw_for_draw_and_rejections_are_trimmed(rt):
    """The fake's temperature sampler makes seeded random choices: drafts get rejected, the KV
    checks hold after every trim, and the text is the one the same seed gives without speculation."""
    sp = preset("creative", seed=11)
    plain = run(rt, "fake://a", "off", max_tokens=200, sampling=sp)
    spec = run(rt, "fake://b", "ngram", max_tokens=200, sampling=sp)
    assert spec.text == plain.text
    assert 0 < spec.n_accepted_tokens < spec.n_drafted_tokens


@pytest.mark.parametrize("kw", [
    dict(stop=["lazy"], max_tokens=300),
    dict(max_tokens=37),
    dict(max_tokens=90, confidence=ConfidenceConfig(threshold=1.0, min_run=2)),
    dict(max_tokens=60, logprobs=2),
])
def test_stops_limits_spans_and_logprobs_behave_as_without_speculation(rt, kw):
    text = "Version 12345 of the quick brown fox. " * 3
    model = f"fake://m?text={text}"
    events = {}
    results = {}
    for mode in ("off", "ngram"):
        stream = rt.submit("Hi", model=rt.spec(model + f"&x={mode}", speculative=mode), chat=False,
                           sampling=GREEDY, **kw)
        events[mode] = [(ev.text, ev.token, ev.logprob) for ev in stream]
        results[mode] = stream.result()
    a, b = results["off"], results["ngram"]
    assert events["off"] == events["ngram"]
    assert (a.text, a.tokens, a.finish_reason, a.n_tokens) == (b.text, b.tokens, b.finish_reason, b.n_tokens)
    assert [s.as_dict() for s in a.spans] == [s.as_dict() for s in b.spans]
    assert b.n_drafted_tokens > 0


def test_reasoning_budget_and_grammar_start_as_without_speculation(rt, fake_engine):
    model = "fake://t?template=qwen3&think=Let me think about it step by step, step by step.&think_loop=1"
    out = {}
    for mode in ("off", "ngram"):
        r = rt.submit("Hi", model=rt.spec(model + f"&x={mode}", speculative=mode), sampling=GREEDY,
                      max_tokens=40, reasoning_budget=30, json_schema={"type": "object"}).result()
        out[mode] = r
    a, b = out["off"], out["ngram"]
    assert (a.reasoning, a.text, a.n_reasoning_tokens, a.reasoning_closed_by) == \
        (b.reasoning, b.text, b.n_reasoning_tokens, b.reasoning_closed_by)
    assert a.reasoning_closed_by == "budget" and b.n_drafted_tokens > 0
    starts = fake_engine.backends[-2].grammar_starts, fake_engine.backends[-1].grammar_starts
    assert starts[0] == starts[1] and starts[0]


def test_a_request_may_turn_speculation_off_or_on(rt):
    r = run(rt, "fake://a", "off", max_tokens=100, speculative="ngram")
    assert r.n_drafted_tokens > 0
    r = run(rt, "fake://a", "ngram", max_tokens=100, speculative="off")
    assert r.n_drafted_tokens == 0
    for bad in ("mtp", "draft:other.gguf"):
        with pytest.raises(InvalidRequest, match="load it with"):
            run(rt, "fake://a", "ngram", max_tokens=10, speculative=bad)
    with pytest.raises(InvalidRequest, match="draft_max"):
        run(rt, "fake://a", "ngram", max_tokens=10, draft_max=0)


def test_speculation_leaves_a_second_request_its_tokens(rt, fake_engine):
    """Two requests decoding together: both get their tokens every step, drafts or not."""
    spec = rt.spec("fake://c", speculative="ngram", n_parallel=2, n_batch=16)
    s1 = rt.submit("Hello", model=spec, chat=False, sampling=GREEDY, max_tokens=150)
    s2 = rt.submit("World", model=spec, chat=False, sampling=GREEDY, max_tokens=150)
    r1, r2 = s1.result(), s2.result()
    assert r1.text == r2.text and r1.n_tokens == r2.n_tokens == 150
    assert max(fake_engine.backends[-1].batch_sizes) <= 16


# -- a draft model through the store ---------------------------------------------------------------------------
def test_a_model_as_its_own_draft_has_every_draft_accepted_and_one_copy_of_the_weights(rt, fake_engine):
    target = "fake://self?position=1"
    plain = run(rt, target + "&x=0", "off", max_tokens=120)
    spec = rt.spec(target, speculative=f"draft:{target}", n_parallel=2)
    loads = fake_engine.loads
    r = rt.submit("Hello", model=spec, chat=False, sampling=GREEDY, max_tokens=120).result()
    assert r.tokens == plain.tokens
    assert r.n_drafted_tokens > 60 and r.n_accepted_tokens == r.n_drafted_tokens
    assert fake_engine.loads == loads + 1   # the draft entry shares the target's weights
    models = {m["spec"]["speculative"]: m for m in rt.status()["models"] if m["path"] == target}
    assert set(models) == {f"draft:{target}", "off"}   # the draft: an ordinary entry of its own
    assert models["off"]["spec"]["n_parallel"] == 2


def test_a_different_draft_model_keeps_the_text_and_is_judged_by_its_acceptance(rt):
    target = "fake://t2?position=1"
    plain = run(rt, target, "off", max_tokens=150)
    other = "fake://d2?position=1&text=The quick brown cat naps under the lazy dog. "
    spec = rt.spec(target, speculative=f"draft:{other}")
    r = rt.submit("Hello", model=spec, chat=False, sampling=GREEDY, max_tokens=150).result()
    assert r.tokens == plain.tokens
    assert 0 < r.n_accepted_tokens < r.n_drafted_tokens


def test_a_draft_model_with_another_vocabulary_is_refused_naming_both(rt):
    with pytest.raises(InvalidRequest, match=r"draft model d3 does not share the vocabulary of t3 \(264 and 300"):
        rt.load(rt.spec("fake://t3", speculative="draft:fake://d3?n_vocab=300"))
    assert not [m for m in rt.status()["models"] if m["path"] == "fake://t3"]   # the target did not stay


def test_drafts_never_run_past_the_context(rt):
    """A generation that fills its context: no draft reaches past it (the fake checks every sequence
    against its slot), and it ends where it ends without speculation."""
    out = {}
    for mode in ("off", "ngram"):
        out[mode] = rt.submit("Hello", model=rt.spec("fake://ctx", speculative=mode, n_ctx=150), chat=False,
                              sampling=GREEDY, max_tokens=500).result()
    assert out["ngram"].tokens == out["off"].tokens and out["ngram"].finish_reason == "length"
    assert out["ngram"].n_drafted_tokens > 0


def test_mtp_on_a_model_without_mtp_layers_is_a_message(rt):
    with pytest.raises(InvalidRequest, match="has no multi-token-prediction layers"):
        rt.load(rt.spec("fake://plain", speculative="mtp"))
    assert not [m for m in rt.status()["models"] if m["path"] == "fake://plain"]


def test_a_model_that_cannot_undo_drafts_speculates_only_when_loaded_for_it():
    """Recurrent layers undo rejected drafts only from the snapshots the context keeps
    (backend.max_rollback): none under "auto" (no drafts then), draft_max when asked by name."""
    from types import SimpleNamespace

    from comfyui_a3b.runtime.local import drafting

    def model(rollback, speculative="auto"):
        return SimpleNamespace(spec=LoadSpec(path="m.gguf", speculative=speculative, draft_max=8), name="q35.gguf",
                               backend=SimpleNamespace(max_rollback=rollback), step_cost=StepCost(),
                               draft_source=None)

    req = SimpleNamespace(speculative=None, draft_max=None)
    assert drafting.for_request(model(0), req) == (None, None)
    with pytest.raises(InvalidRequest, match="recurrent layers"):
        drafting.for_request(model(0), SimpleNamespace(speculative="ngram", draft_max=None))
    drafter, control = drafting.for_request(model(3, "ngram"), req)
    assert isinstance(drafter, NgramDrafter) and control.k_max == 3
    drafter, control = drafting.for_request(model(None), req)   # attention only: as before
    assert isinstance(drafter, NgramDrafter) and control.k_max == 8


# -- drafts even across a step's rows (drafting.even, slots.passes) --------------------------------
def test_passes_follow_llamas_equal_split():
    from comfyui_a3b.runtime.local.slots import passes

    assert passes([(0, 1), (1, 1), (2, 1)]) == 1
    assert passes([(0, 1), (1, 5), (2, 1)]) == 2            # the drafting row's four more
    assert passes([(0, 1), (1, 5), (2, 1), (3, 5)]) == 3    # 1 and 3 do not follow each other
    assert passes([(0, 4), (1, 4), (2, 4)]) == 1            # every row drafts three
    assert passes([(0, 5), (1, 5), (2, 4), (3, 5)]) == 3    # one drafts less: 0-1, then 3 alone


def _rows(drafts: list[int], rate: float, priorities: list[int] | None = None):
    from types import SimpleNamespace

    from comfyui_a3b.runtime.local.steps import DecodeStep, Entry

    entries = []
    for i, k in enumerate(drafts):
        job = SimpleNamespace(slot=SimpleNamespace(seq_id=i), control=SimpleNamespace(rate=rate),
                              base_priority=priorities[i] if priorities else PRIORITY_BATCH)
        entries.append(Entry(job, 10, 1, output=i, room=k, draft=[7] * k))
    return DecodeStep(entries)


def test_a_lone_drafting_row_beside_many_drafts_nothing():
    from comfyui_a3b.runtime.local.drafting import even

    step = _rows([0] * 5 + [4] + [0] * 10, 0.8)   # 16 rows, one drafts: a second pass for 2.4 tokens
    even(step)
    assert all(not e.draft for e in step.entries)


def test_rows_that_all_draft_are_cut_to_the_shortest_draft():
    from comfyui_a3b.runtime.local.drafting import even

    step = _rows([4, 4, 3, 4], 1.0)
    even(step)
    assert [len(e.draft) for e in step.entries] == [3, 3, 3, 3]


def test_drafts_that_pay_for_their_pass_stay_as_proposed():
    from comfyui_a3b.runtime.local.drafting import even

    step = _rows([4] * 12 + [0] * 4, 0.9)   # 12 rows x 3.1 expected tokens for one more pass
    even(step)
    assert [len(e.draft) for e in step.entries] == [4] * 12 + [0] * 4
    one = _rows([6], 0.2)                   # a single sequence: its drafts ride in its own pass
    even(one)
    assert len(one.entries[0].draft) == 6


def test_a_batch_rider_does_not_cut_an_editors_drafts():
    from comfyui_a3b.runtime.local.drafting import even

    # the editor's 1.3 expected tokens for a second pass: worth it to the editor, not to the two rows
    mixed = _rows([4, 0], 0.6, [PRIORITY_INTERACTIVE, PRIORITY_BATCH])
    even(mixed)
    assert [len(e.draft) for e in mixed.entries] == [4, 0]
    alike = _rows([4, 0], 0.6)
    even(alike)
    assert [len(e.draft) for e in alike.entries] == [0, 0]
