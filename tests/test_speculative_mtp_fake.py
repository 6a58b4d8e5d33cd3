"""The MTP drafter's bookkeeping (fast tier): what it asks of the MTP context and when, with a fake
context in place of llama.cpp's."""
from __future__ import annotations

from comfyui_a3b.runtime.local.draftmodel import MtpDrafter, MtpSource
from comfyui_a3b.runtime.local.drafting import fill
from comfyui_a3b.runtime.local.scheduler import DecodeStep, Entry


class FakeMtp:
    """Drafts `token + 1, token + 2, ...`; counts batched drafting passes; fails when told to."""

    def __init__(self):
        self.asked: dict[int, tuple[int, int, int]] = {}
        self.passes = 0
        self.fail = False
        self.done: dict[int, list[int]] = {}

    def want(self, seq_id, token, pos, k):
        self.asked[seq_id] = (token, pos, k)

    def take(self, seq_id):
        if self.fail:
            raise RuntimeError("llama_process on the MTP context returned -1")
        if self.asked:   # the first take of a step drafts for every request asked
            self.passes += 1
            self.done = {s: [t + i + 1 for i in range(k)] for s, (t, _, k) in self.asked.items()}
            self.asked = {}
        return self.done.pop(seq_id, [])


class Slot:
    def __init__(self, seq_id):
        self.seq_id = seq_id


class Job:
    def __init__(self, seq, seq_id, drafter):
        self.seq, self.slot, self.drafter, self.priority = seq, Slot(seq_id), drafter, 0
        self.control, self.base_priority = None, 0


def test_every_request_of_a_step_drafts_in_one_pass_from_its_next_token_and_position():
    ctx = FakeMtp()
    src = MtpSource(ctx)
    jobs = [Job([5, 6, 7], 0, src.new_drafter()), Job([9, 10], 1, src.new_drafter())]
    entries = [Entry(jobs[0], 2, 1, output=0, room=3), Entry(jobs[1], 1, 1, output=1, room=2)]
    for j in jobs:
        j.job = j
    fill(DecodeStep(entries))
    assert ctx.passes == 1 and ctx.done == {}   # both drafted in one pass: 8, 9, 10 and 11, 12
    # then cut to the shortest: drafts of 3 and 2 beside each other are two passes of the model
    assert [e.draft for e in entries] == [[8, 9], [11, 12]]
    assert [e.output for e in entries] == [0, 3]   # rows renumbered after the drafts


def test_no_room_no_ask_and_three_failures_stop_drafting():
    ctx = FakeMtp()
    d = MtpDrafter(ctx)
    d.extend([1, 2])
    d.place(0, 1)
    d.begin(0)
    assert d.end() == [] and not ctx.asked
    ctx.fail = True
    for _ in range(3):
        d.begin(2)
        assert d.end() == []
    assert d.failures == 3
    ctx.asked.clear()
    d.begin(2)
    assert not ctx.asked and d.end() == []
