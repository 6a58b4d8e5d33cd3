"""The scheduling policy alone: plain Python, deterministic, milliseconds (runtime/local/scheduler.py)."""
from __future__ import annotations

import pytest

from comfyui_a3b.runtime.generation import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from comfyui_a3b.runtime.local.scheduler import (DecodeStep, EmbedJob, EmbedStep, Job, Policy, Trim,
                                                 common_prefix)


def job(tokens, prio=PRIORITY_BATCH, cancelled=False):
    flag = [cancelled]
    j = Job(list(tokens), prio, cancelled=lambda: flag[0])
    j.flag = flag
    return j


def decode_all(p: Policy, step: DecodeStep, sample: int = 7) -> None:
    """What the worker does after a decode: record it, then append a sampled token to outputs."""
    p.decoded(step)
    for e in step.entries:
        if e.output is not None:
            e.job.seq.append(sample)


def test_waiting_jobs_take_free_slots_highest_priority_then_oldest():
    p = Policy(n_slots=2, batch_tokens=64)
    a, b, c = job([1, 2]), job([3, 4], PRIORITY_INTERACTIVE), job([5, 6])
    for j in (a, b, c):
        p.submit(j)
    adm = p.admit()
    assert {s.job for s in p.slots} == {a, b} and p.pending == [c]
    assert adm.first_placed == [b, a] and not adm.trims and not adm.preempted


def test_slot_with_the_longest_common_prefix_is_chosen_and_trimmed():
    p = Policy(n_slots=3, batch_tokens=64)
    p.slots[0].tokens = [9, 9, 9]
    p.slots[1].tokens = [1, 2, 3, 4, 5]
    p.slots[2].tokens = [1, 2]
    j = job([1, 2, 3, 7])
    p.submit(j)
    adm = p.admit()
    assert j.slot is p.slots[1]
    assert adm.trims == [Trim(1, 3)] and p.slots[1].tokens == [1, 2, 3]
    assert j.fed == 3 and j.n_cached == 3


def _serve(p: Policy, tokens: list[int], generated: int = 8) -> Job:
    """One request through the policy alone: placed, its prompt read, `generated` tokens, released."""
    j = job(tokens)
    p.submit(j)
    p.admit()
    while len(j.seq) < len(tokens) + generated:
        step = p.next_step()
        decode_all(p, step)
    j.slot_id = j.slot.seq_id
    p.release(j)
    return j


def test_prompts_sharing_a_start_keep_each_others_caches():
    # "Request 0: ...", "Request 1: ...": two tokens in common; each took the slot of the one before
    # (the longest prefix), so the same prompt sent again was read whole
    p = Policy(n_slots=4, batch_tokens=64)
    prompts = [[1, 50, 100 + i] + list(range(200, 226)) for i in range(3)]
    firsts = [_serve(p, t) for t in prompts]
    assert [j.n_cached for j in firsts] == [0, 0, 0]
    assert len({j.slot_id for j in firsts}) == 3
    again = [_serve(p, t) for t in prompts]
    assert [j.n_cached for j in again] == [len(t) - 1 for t in prompts]


def test_with_every_slot_holding_another_cache_the_least_recently_used_one_goes():
    p = Policy(n_slots=3, batch_tokens=64)
    for i, n in enumerate((40, 10, 60)):   # released in this order; the longest cache is not the oldest
        _serve(p, [1, 300 + i] + [400 + i] * n)
    oldest = min(p.slots, key=lambda s: s.last_used)
    j = job([1, 999, 5, 6])
    p.submit(j)
    p.admit()
    assert j.slot is oldest and j.n_cached == 1


def test_the_same_prompt_again_takes_its_cache_before_an_empty_slot():
    p = Policy(n_slots=3, batch_tokens=64)
    prompt = [1, 50] + list(range(200, 231))
    _serve(p, prompt, generated=128)    # the answer is four times the prompt
    j = _serve(p, prompt)
    assert j.n_cached == len(prompt) - 1 and j.slot_id == 0


def test_an_identical_prompt_keeps_one_token_to_decode():
    p = Policy(n_slots=1, batch_tokens=64)
    p.slots[0].tokens = [1, 2, 3]
    j = job([1, 2, 3])
    p.submit(j)
    adm = p.admit()
    assert j.fed == 2 and adm.trims == [Trim(0, 2)]   # its logits give the first new token
    step = p.next_step()
    assert [(e.start, e.count, e.output) for e in step.entries] == [(2, 1, 0)]


def test_a_recurrent_cache_is_cut_back_only_as_far_as_its_snapshots_reach():
    # max_rollback: what a recurrent layer can step back (the context's snapshots); a prefix that
    # ends further back is of no use there, and the slot starts over
    p = Policy(n_slots=1, batch_tokens=64, max_rollback=2)
    p.slots[0].tokens = [1, 2, 3, 4, 5]
    j = job([1, 2, 3, 9])
    p.submit(j)
    adm = p.admit()
    assert adm.trims == [Trim(0, 3)] and j.fed == 3          # two tokens back: within reach
    p.release(j)
    p.slots[0].tokens = [1, 2, 3, 4, 5, 6]
    k = job([1, 2, 7])
    p.submit(k)
    adm = p.admit()
    assert adm.trims == [Trim(0, 0)] and k.fed == 0 and k.n_cached == 0
    p.release(k)
    p.slots[0].tokens = [1, 2, 3]
    cont = job([1, 2, 3, 4, 5])                               # a continuation: nothing to cut
    p.submit(cont)
    adm = p.admit()
    assert not adm.trims and cont.fed == 3


def test_interactive_request_preempts_the_newest_lowest_priority_job():
    p = Policy(n_slots=2, batch_tokens=64)
    a, b = job([1]), job([2])
    p.submit(a)
    p.submit(b)
    p.admit()
    urgent = job([3], PRIORITY_INTERACTIVE)
    p.submit(urgent)
    adm = p.admit()
    assert adm.preempted == [b] and b.slot is None and urgent.slot is not None and p.pending == [b]
    assert p.preemptions == 1
    c = job([4], PRIORITY_INTERACTIVE)
    p.submit(c)
    assert p.admit().preempted == [a]
    # a job of the same priority never preempts
    d = job([5], PRIORITY_INTERACTIVE)
    p.submit(d)
    assert not p.admit().preempted and d in p.pending


def test_only_the_top_priority_class_decodes_in_a_step():
    p = Policy(n_slots=3, batch_tokens=64)
    lo, hi = job([1, 2, 3]), job([4, 5], PRIORITY_INTERACTIVE)
    p.submit(lo)
    p.submit(hi)
    p.admit()
    step = p.next_step()
    assert [e.job for e in step.entries] == [hi]


def test_decoding_sequences_go_first_and_prompt_chunks_share_the_rest_of_the_budget():
    p = Policy(n_slots=3, batch_tokens=8)
    a = job([1, 2])
    p.submit(a)
    p.admit()
    decode_all(p, p.next_step())           # a is now decoding: one token per step
    big, small = job(list(range(100, 120))), job([50, 51, 52])
    p.submit(big)
    p.submit(small)
    p.admit()
    step = p.next_step()
    # the shortest prompt gets its share first; the rows go in slot order (a, big, small)
    assert [(e.job, e.count) for e in step.entries] == [(a, 1), (big, 4), (small, 3)]
    assert [e.job.slot.seq_id for e in step.entries] == [0, 1, 2]
    assert step.n_tokens == 8
    out = {e.job: e.output for e in step.entries}
    assert out[a] == 0 and out[small] == 7 and out[big] is None   # big's prompt is not read to its end yet
    decode_all(p, step)
    assert big.fed == 4 and big.remaining == 16
    # the long prompt goes on over the next steps while the others keep decoding
    step = p.next_step()
    assert [(e.job, e.count) for e in step.entries] == [(a, 1), (big, 6), (small, 1)]


def test_cancelled_jobs_are_dropped_from_the_queue_and_reported_running():
    p = Policy(n_slots=1, batch_tokens=8)
    running, waiting = job([1]), job([2])
    p.submit(running)
    p.admit()
    p.submit(waiting)
    waiting.flag[0] = True
    adm = p.admit()
    assert adm.dropped == [waiting] and not p.pending
    running.flag[0] = True
    assert p.cancelled_running() == [running]


def test_release_keeps_the_cache_for_the_next_request_unless_told_not_to():
    p = Policy(n_slots=1, batch_tokens=8)
    j = job([1, 2, 3])
    p.submit(j)
    p.admit()
    decode_all(p, p.next_step())
    assert p.release(j) is None and p.slots[0].tokens == [1, 2, 3] and p.slots[0].job is None
    j2 = job([1, 2, 3, 4])
    p.submit(j2)
    p.admit()
    assert j2.fed == 3 and j2.n_cached == 3       # the prefix is reused
    assert p.release(j2, keep_cache=False) == Trim(0, 0) and p.slots[0].tokens == []


def test_embeddings_run_in_small_packs_and_yield_to_interactive_generation():
    p = Policy(n_slots=1, batch_tokens=8, embed_pack_tokens=6, embed_pack_texts=2)
    e = EmbedJob([[1, 2], [3, 4], [5, 6, 7, 8, 9, 10, 11], [12]], "mean")
    p.submit_embed(e)
    p.admit()
    s1 = p.next_step()
    assert isinstance(s1, EmbedStep) and (s1.first, s1.count) == (0, 2)
    assert not p.embedded(s1)
    s2 = p.next_step()
    assert (s2.first, s2.count) == (2, 1)          # a long text goes alone, however long
    p.embedded(s2)
    urgent = job([1, 2], PRIORITY_INTERACTIVE)     # an editor request arrives between two packs
    p.submit(urgent)
    p.admit()
    step = p.next_step()
    assert isinstance(step, DecodeStep) and step.entries[0].job is urgent
    p.release(urgent)
    s3 = p.next_step()
    assert (s3.first, s3.count) == (3, 1) and p.embedded(s3) and not p.embeds


def test_embedding_and_generation_of_the_same_priority_take_turns():
    p = Policy(n_slots=1, batch_tokens=8, embed_pack_tokens=2, embed_pack_texts=1)
    g = job([1, 2])
    p.submit(g)
    p.submit_embed(EmbedJob([[1]] * 4, "mean"))
    p.admit()
    kinds = []
    for _ in range(6):
        step = p.next_step()
        kinds.append(type(step).__name__)
        if isinstance(step, DecodeStep):
            decode_all(p, step)
        else:
            p.embedded(step)
    assert kinds == ["EmbedStep", "DecodeStep"] * 3


def test_cancelled_embedding_is_dropped_at_admission():
    p = Policy(n_slots=1, batch_tokens=8)
    flag = [False]
    e = EmbedJob([[1]] * 3, "mean", cancelled=lambda: flag[0])
    p.submit_embed(e)
    flag[0] = True
    assert p.next_step() is None
    assert p.admit().dropped_embeds == [e] and not p.busy()


def test_drain_returns_everything_and_leaves_the_policy_empty():
    p = Policy(n_slots=1, batch_tokens=8)
    a, b = job([1]), job([2])
    p.submit(a)
    p.submit(b)
    p.admit()
    e = EmbedJob([[1]], "mean")
    p.submit_embed(e)
    jobs, embeds = p.drain()
    assert set(jobs) == {a, b} and embeds == [e] and not p.busy() and a.slot is None


def test_bad_policy_sizes_are_refused():
    with pytest.raises(ValueError):
        Policy(n_slots=0, batch_tokens=8)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0


def test_while_editors_are_active_lower_priority_prompts_are_read_in_small_chunks():
    now = [100.0]
    p = Policy(n_slots=2, batch_tokens=256, yield_tokens=64, interactive_window_s=30.0, clock=lambda: now[0])
    long_prompt = job(range(1000, 1600))
    p.submit(long_prompt)
    p.admit()
    assert p.next_step().entries[0].count == 256          # no editor around: full batches
    editor = job([1, 2], PRIORITY_INTERACTIVE)
    p.submit(editor)
    p.admit()
    p.release(editor)                                     # the editor request came and went
    assert p.editors_active()
    assert p.next_step().entries[0].count == 64           # now the workflow yields every 64 tokens
    now[0] += 31
    assert not p.editors_active() and p.next_step().entries[0].count == 256


def test_a_starving_batch_job_is_promoted_but_a_new_editor_request_still_goes_first():
    now = [0.0]
    p = Policy(n_slots=1, batch_tokens=64, promote_after_s=10.0, clock=lambda: now[0])
    editor = job([1, 2], PRIORITY_INTERACTIVE)
    p.submit(editor)
    p.admit()
    workflow = job([3, 4])
    p.submit(workflow)
    for _ in range(3):                       # editors keep the only slot busy
        now[0] += 3
        assert p.admit().first_placed == [] and workflow.priority == PRIORITY_BATCH
    now[0] += 2                               # waited 11 s
    p.admit()
    assert workflow.priority == PRIORITY_INTERACTIVE and workflow.base_priority == PRIORITY_BATCH
    assert p.promotions == 1
    p.release(editor)                         # the editor request ends, another one comes
    nxt = job([5, 6], PRIORITY_INTERACTIVE)
    p.submit(nxt)
    assert p.admit().first_placed == [nxt]    # the editor never waits for the workflow's whole run
    p.release(nxt)
    assert p.admit().first_placed == [workflow]
    # a new editor request takes the slot back at once: a promoted job is preempted like any batch job
    p.submit(job([7, 8], PRIORITY_INTERACTIVE))
    assert p.admit().preempted == [workflow]


def test_a_paused_batch_job_is_promoted_and_then_decodes_beside_editors():
    now = [0.0]
    p = Policy(n_slots=2, batch_tokens=64, promote_after_s=10.0, clock=lambda: now[0])
    workflow = job([3, 4])
    p.submit(workflow)
    p.admit()
    decode_all(p, p.next_step())              # the workflow is decoding
    editor = job([1, 2], PRIORITY_INTERACTIVE)
    p.submit(editor)
    p.admit()
    assert [e.job for e in p.next_step().entries] == [editor]   # the workflow pauses
    now[0] += 11
    p.admit()
    step = p.next_step()
    assert {(e.job, e.count) for e in step.entries} == {(editor, 2), (workflow, 1)}   # one token beside it


def run_steps(p: Policy, n: int) -> list:
    """Take n steps as the worker does; the kinds and jobs of each."""
    out = []
    for _ in range(n):
        p.admit()
        step = p.next_step()
        if step is None:
            out.append(None)
        elif isinstance(step, EmbedStep):
            p.embedded(step)
            out.append(("embed", step.job))
        else:
            decode_all(p, step)
            out.append(("decode", [(e.job, e.count) for e in step.entries]))
    return out


def batch_units(steps: list, editor_jobs) -> int:
    """Steps that spent time on batch work: embedding packs, prompt chunks of batch jobs."""
    n = 0
    for s in steps:
        if s is None:
            continue
        if s[0] == "embed":
            n += not any(s[1] is j for j in editor_jobs)
        else:
            n += any(j not in editor_jobs and c > 1 for j, c in s[1])
    return n


def test_a_queued_interactive_request_holds_back_batch_embeddings():
    p = Policy(n_slots=1, batch_tokens=8, embed_pack_tokens=2, embed_pack_texts=1)
    p.submit_embed(EmbedJob([[1]] * 5, "mean"))
    editor = job([1, 2, 3], PRIORITY_INTERACTIVE)
    p.submit(editor)
    # queued, not placed yet: it counts as much as a running request
    assert not isinstance(p.next_step(), EmbedStep)
    p.admit()
    step = p.next_step()
    assert isinstance(step, DecodeStep) and step.entries[0].job is editor


def test_promoted_embeddings_cost_an_editor_request_one_pack_at_most():
    now = [0.0]
    p = Policy(n_slots=2, batch_tokens=64, embed_pack_tokens=2, embed_pack_texts=1, promote_after_s=10.0,
               clock=lambda: now[0])
    indexing = [EmbedJob([[1]] * 50, "mean"), EmbedJob([[2]] * 50, "mean")]
    for e in indexing:
        p.submit_embed(e)
    now[0] += 11                               # both waited past promote_after_s
    editor = job(range(100, 110), PRIORITY_INTERACTIVE)
    p.submit(editor)
    p.admit()
    assert all(e.priority == PRIORITY_INTERACTIVE for e in indexing)   # promoted
    steps = []
    for _ in range(30):                        # the editor request's prompt, then 29 tokens
        steps += run_steps(p, 1)
        if editor.slot is not None and len(editor.seq) - len(editor.prompt_tokens) >= 20:
            break
    assert batch_units(steps, {editor}) <= 1, steps
    p.release(editor)
    # with no editor around, the indexing goes on
    assert all(s[0] == "embed" for s in run_steps(p, 3))


def test_a_promoted_prompt_is_read_one_small_chunk_per_editor_request():
    now = [0.0]
    p = Policy(n_slots=2, batch_tokens=256, yield_tokens=16, promote_after_s=10.0, clock=lambda: now[0])
    prewarm = job(range(1000, 1400))           # a long batch prompt, waiting behind the editors
    editor = job(range(10, 20), PRIORITY_INTERACTIVE)
    p.submit(editor)
    p.admit()
    p.submit(prewarm)
    p.admit()
    now[0] += 11
    steps = run_steps(p, 12)
    assert prewarm.priority == PRIORITY_INTERACTIVE   # promoted
    chunks = [c for s in steps for j, c in s[1] if j is prewarm]
    assert chunks == [16]                      # one small chunk for this editor request, not 256 a step
    p.release(editor)
    nxt = job(range(30, 40), PRIORITY_INTERACTIVE)   # the next editor request lets it go on once more
    p.submit(nxt)
    steps = run_steps(p, 6)
    assert [c for s in steps for j, c in s[1] if j is prewarm] == [16]


def test_an_editor_request_arriving_during_a_batch_pack_gets_no_second_one():
    now = [0.0]
    p = Policy(n_slots=2, batch_tokens=64, embed_pack_tokens=2, embed_pack_texts=1, promote_after_s=10.0,
               clock=lambda: now[0])
    indexing = EmbedJob([[1]] * 50, "mean")
    p.submit_embed(indexing)
    p.admit()
    step = p.next_step()                       # a pack is in flight...
    assert isinstance(step, EmbedStep)
    editor = job(range(100, 110), PRIORITY_INTERACTIVE)
    p.submit(editor)                           # ...when the editor request arrives: that is its wait
    p.embedded(step)
    now[0] += 11                               # the indexing is promoted meanwhile
    steps = run_steps(p, 10)
    assert indexing.priority == PRIORITY_INTERACTIVE and batch_units(steps, {editor}) == 0, steps


