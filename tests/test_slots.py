"""Steps llama.cpp decodes in one pass: rows in slot order, the running slots kept side by side
(runtime/local/slots.py), checked against a port of llama.cpp's equal split (fakeengine.equal_split_passes)."""
from __future__ import annotations

import random

import pytest
from fakeengine import equal_split_passes

from comfyui_a3b.runtime.generation import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from comfyui_a3b.runtime.local.scheduler import Job, Policy
from comfyui_a3b.runtime.local.slots import Slot, gather, placement_key, runs


def test_the_port_of_llamas_equal_split():
    assert equal_split_passes([0, 1, 2, 3], 256) == 1
    assert equal_split_passes([3, 2, 1, 0], 256) == 4      # descending: each id starts a micro-batch
    assert equal_split_passes([0, 2, 5, 9], 256) == 4      # increasing but not consecutive
    assert equal_split_passes([0, 1, 3, 4], 256) == 2
    assert equal_split_passes([0, 1, 1, 1, 2], 256) == 2   # a chunk of 3 beside single rows
    assert equal_split_passes([0, 0, 1, 1], 256) == 1      # the same count from each
    assert equal_split_passes([0, 1, 2, 3], 2) == 2        # at most n_ubatch tokens


def test_runs_and_what_a_slot_does_to_them():
    assert runs([]) == 0 and runs([4]) == 1 and runs([0, 1, 2]) == 1 and runs([0, 2, 3, 7]) == 3
    s = Slot(2)
    # filling a hole beats extending a run, which beats starting one, at the same cached prefix
    fill, extend, alone = (placement_key(s, 10, r) for r in ({1, 3}, {0, 1}, {7}))
    assert fill > extend > alone
    # a much longer cached prefix still wins
    assert placement_key(Slot(9), 10 + 200, {0, 1}) > placement_key(Slot(2), 10, {0, 1})


def test_gather_moves_the_fewest_slots_into_one_run():
    slots = [Slot(i) for i in range(8)]
    for i in (4, 5, 6, 0):
        slots[i].job = object()
    moves = gather(slots, {0, 4, 5, 6})
    assert [(a.seq_id, b.seq_id) for a, b in moves] == [(0, 3)]   # one move, not three
    assert gather(slots, {4, 5, 6}) == []
    # a slot another request waits in is no hole: the window goes around it
    slots[4].job = slots[6].job = None
    slots[1].job = object()
    assert [(a.seq_id, b.seq_id) for a, b in gather(slots, {0, 5})] == [(0, 4)]
    # no window of free or own slots: nothing moves
    for s in slots:
        s.job = object()
    assert gather(slots, {0, 2}) == []


def _job(n: int, prio: int = PRIORITY_BATCH) -> Job:
    return Job([random.randrange(1000) for _ in range(n)], prio)


def _decoding_only(step) -> bool:
    return all(e.count == 1 and not e.draft and e.unit is None for e in step.entries)


def _window_exists(p: Policy, together: set[int]) -> bool:
    k = len(together)
    ok = [s.job is None or s.seq_id in together for s in p.slots]
    return any(all(ok[a:a + k]) for a in range(len(ok) - k + 1))


def _churn(seed: int, classes: bool) -> tuple[int, int, int]:
    """Requests submitted, ended (cache kept or dropped), preempted and placed again at random;
    (decoding steps, those in one pass, those that could not be: no window of free or own slots)."""
    random.seed(seed)
    p = Policy(n_slots=8, batch_tokens=64, can_move=True)
    checked = one_pass = blocked = 0
    for _ in range(300):
        r = random.random()
        if r < 0.3 and len(p.running()) + len(p.pending) < 12:
            prio = PRIORITY_INTERACTIVE if classes and random.random() < 0.2 else PRIORITY_BATCH
            p.submit(_job(random.randrange(2, 40), prio))
        elif r < 0.5 and p.running():   # a request ends: its slot is released, its cache kept or not
            live = p.running()
            p.release(live[random.randrange(len(live))], keep_cache=random.random() < 0.7)
        p.admit()
        step = p.next_step()
        if step is None:
            continue
        for m in step.moves:   # the job goes on in the destination, with a copy of its cache
            assert p.slots[m.dst].job is not None and p.slots[m.dst].tokens == p.slots[m.src].tokens
        rows = [e.job.slot.seq_id for e in step.entries for _ in range(e.count)]
        assert rows == sorted(rows), "rows in ascending slot order"
        if _decoding_only(step):
            checked += 1
            if equal_split_passes(rows, p.batch_tokens) == 1:
                one_pass += 1
            else:
                assert not _window_exists(p, set(rows)), "a step left in pieces although its slots could gather"
                blocked += 1
        p.decoded(step)
        for e in step.entries:
            if e.output is not None:
                e.job.seq.append(7)
    return checked, one_pass, blocked


@pytest.mark.parametrize("seed", range(20))
def test_decode_steps_are_one_pass_whatever_order_slots_were_used_and_released(seed):
    checked, one_pass, _ = _churn(seed, classes=False)
    assert checked > 50 and one_pass == checked


@pytest.mark.parametrize("seed", range(10))
def test_with_priorities_a_step_is_in_pieces_only_where_paused_requests_hold_every_slot_between(seed):
    # editors decode alone while batch requests wait in their slots; a step's slots gather where
    # free slots allow, else (every slot between them held by a waiting request) it takes more passes
    checked, one_pass, blocked = _churn(seed, classes=True)
    assert checked > 50 and one_pass + blocked == checked and one_pass > blocked


def test_without_moves_new_requests_still_fill_the_holes():
    p = Policy(n_slots=6, batch_tokens=64)
    jobs = [_job(5) for _ in range(6)]
    for j in jobs:
        p.submit(j)
    p.admit()
    for j in (jobs[1], jobs[3], jobs[4]):   # holes at 1, 3 and 4
        p.release(j)
    p.admit()
    assert not p.next_step().moves          # this engine cannot copy a slot
    fresh = [_job(5) for _ in range(3)]
    for j in fresh:
        p.submit(j)
    p.admit()
    assert sorted(j.slot.seq_id for j in fresh) == [1, 3, 4]
    assert runs({s.seq_id for s in p.slots if s.job}) == 1


def test_a_long_cached_prefix_is_worth_a_move():
    p = Policy(n_slots=8, batch_tokens=64, can_move=True)
    a = _job(5)
    p.submit(a)
    p.admit()
    prompt = list(range(500, 800))
    p.slots[6].tokens = prompt[:250]
    b = Job(prompt, PRIORITY_BATCH)
    p.submit(b)
    p.admit()
    assert b.n_cached == 250 and b.fed == 250 and b.slot is p.slots[6]   # the cached prefix is kept ...
    step = p.next_step()
    assert [(m.src, m.dst) for m in step.moves] == [(6, 1)]               # ... and the slot moved beside a's
    assert b.slot is p.slots[1] and p.slots[1].tokens == prompt[:250]


def test_a_short_common_prefix_does_not_split_the_running_slots():
    p = Policy(n_slots=8, batch_tokens=64)
    a = _job(5)
    p.submit(a)
    p.admit()
    template = [1, 2, 3]                    # every chat shares its template's first tokens
    for i in range(1, 8):
        p.slots[i].tokens = template + [100 + i]
    b = Job(template + [9, 9], PRIORITY_BATCH)
    p.submit(b)
    p.admit()
    assert b.slot is p.slots[1] and b.fed == 3
