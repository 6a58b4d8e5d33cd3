"""The reasoning splitter (runtime/reasoning.py), pure logic: every format, every split position.

Each output is fed whole, then cut at every position into two pieces, then one byte at a time: the
reasoning and the answer must come out the same every time, and no piece of a tag ever reaches
either channel.
"""
from __future__ import annotations

import time

import pytest

from comfyui_a3b.runtime.generation import ConfidenceConfig
from comfyui_a3b.runtime.reasoning import (GPT_OSS, NONE, THINK, ChannelAssembler, detect_format, start_state,
                                           thinking_switch)

from templates import HARMONY, QWEN3, R1

NO_CONF = ConfidenceConfig(enabled=False)


def feed(fmt: str, pieces: list[bytes], start: str = "start", stop=()) -> tuple[str, str, ChannelAssembler]:
    a = ChannelAssembler(fmt, tuple(stop), NO_CONF, start)
    r_all, a_all = "", ""
    for p in pieces:
        r, t = a.add(p, None)
        r_all, a_all = r_all + r, a_all + t
    r, t = a.flush()
    r_all, a_all = r_all + r, a_all + t
    text, _, reasoning, _ = a.final()
    assert (text, reasoning) == (a_all, r_all), "the streamed text differs from the result's"
    return r_all, a_all, a


def splits(data: bytes):
    """The text whole, in two pieces cut at every position, and byte by byte."""
    yield [data]
    for i in range(1, len(data)):
        yield [data[:i], data[i:]]
    yield [data[i:i + 1] for i in range(len(data))]


CASES = [
    # (format, start, output, reasoning, answer)
    (THINK, "start", "<think>\nI add 2 and 2.\n</think>\n\nIt is 4.", "I add 2 and 2.", "It is 4."),
    (THINK, "start", "  <think>a</think>b", "a", "b"),
    # closed by the prompt's template (DeepSeek-R1 style): no opening tag in the output
    (THINK, "reasoning", "Hmm.\n</think>\n\nYes.", "Hmm.", "Yes."),
    # nested look-alikes: a <think> inside the reasoning is text, the first </think> closes
    (THINK, "start", "<think>quote: <think> ok</think>done", "quote: <think> ok", "done"),
    # after the block, tags in the answer are text: code samples, a string literal
    (THINK, "start", "<think>x</think>\n\nprint('</think>')\n<think>", "x", "print('</think>')\n<think>"),
    (THINK, "start", "s = \"</think>\"  # no block", "", "s = \"</think>\"  # no block"),
    # no block at all: the answer keeps its leading whitespace
    (THINK, "start", "  Hello <think> there", "", "  Hello <think> there"),
    # unclosed at the limit: all of it is reasoning, no answer
    (THINK, "start", "<think>\nstill thinking <thi", "still thinking <thi", ""),
    (THINK, "reasoning", "never closed </thi", "never closed </thi", ""),
    # a prefix of <think> and nothing more: it was text
    (THINK, "start", "<thi", "", "<thi"),
    # thinking switched off in the prompt: everything is the answer
    (THINK, "answer", "\n\nDirect.", "", "Direct."),
    (GPT_OSS, "start", "<|channel|>analysis<|message|>Let me see.<|end|><|start|>assistant<|channel|>final"
                       "<|message|>Done.<|return|>", "Let me see.", "Done."),
    (GPT_OSS, "start", "Plain answer", "", "Plain answer"),
    (GPT_OSS, "start", "<|channel|>final<|message|>Only final", "", "Only final"),
    (NONE, "start", "<think>not a block here</think>", "", "<think>not a block here</think>"),
]


@pytest.mark.parametrize("fmt,start,out,want_r,want_a", CASES)
def test_every_split_gives_the_same_channels(fmt, start, out, want_r, want_a):
    for pieces in splits(out.encode()):
        r, a, _ = feed(fmt, pieces, start)
        assert (r, a) == (want_r, want_a), pieces


def test_no_half_tag_is_ever_released():
    out = "<think>abc</think>def"
    a = ChannelAssembler(THINK, (), NO_CONF)
    seen = []
    for b in out.encode():
        seen.append(a.add(bytes([b]), None))
    for r, t in seen:
        assert "<" not in r and "<" not in t, seen


def test_multibyte_text_split_inside_a_character():
    r, a, _ = feed(THINK, [b"<think>\xc3", b"\xa9t\xc3\xa9</th", b"ink>\xe2\x82", b"\xac"])
    assert (r, a) == ("\u00e9t\u00e9", "\u20ac")


def test_tokens_are_counted_per_channel():
    pieces = [b"<think>", b"a", b"b", b"</think>", b"x", b"y", b"z"]
    _, _, asm = feed(THINK, pieces)
    # the block's content and its closing tag are reasoning tokens; the opening tag is neither
    assert (asm.n_reasoning, asm.n_answer, asm.closed_by) == (3, 3, "model")


def test_stop_strings_apply_to_the_answer_only():
    r, a, asm = feed(THINK, [b"<think>STOP here</think>", b"ok STOP rest"], stop=["STOP"])
    assert (r, a, asm.stopped) == ("STOP here", "ok ", True)


def test_close_injects_the_end_text():
    a = ChannelAssembler(THINK, (), NO_CONF, "reasoning")
    assert a.add(b"thinking hard", None) == ("thinking hard", "")
    assert a.close() == ("", "")
    assert not a.in_reasoning and a.closed_by == "budget"
    assert a.add(b"Answer", None) == ("", "Answer")


def test_entropy_goes_to_the_channel_of_the_text():
    a = ChannelAssembler(THINK, (), ConfidenceConfig(enabled=True, threshold=1.0, min_run=2))
    for piece, ent in [(b"<think>", 0.1), (b"r1", 3.0), (b"r2", 3.0), (b"r3", 0.1), (b"</think>", 0.1),
                       (b"a1", 3.0), (b"a2", 3.0), (b"a3", 0.1)]:
        a.add(piece, ent)
    a.flush()
    text, spans, reasoning, rspans = a.final()
    assert [s.text for s in rspans] == ["r1r2"]
    assert [s.text for s in spans] == ["a1a2"]


def test_linear_time_on_a_long_output():
    """A long reasoning byte by byte: time grows linearly (x10 text, well under x30 time)."""
    def run(n):
        data = b"<think>" + b"<thin " * n + b"</think>" + b"x" * n
        a = ChannelAssembler(THINK, (), NO_CONF)
        t = time.perf_counter()
        for i in range(len(data)):
            a.add(data[i:i + 1], None)
        return time.perf_counter() - t
    small, big = min(run(2000) for _ in range(3)), min(run(20000) for _ in range(3))
    assert big < 30 * small, (small, big)


def test_formats_and_switches_from_templates():
    assert detect_format(QWEN3) == THINK and thinking_switch(QWEN3) == "enable_thinking"
    assert detect_format(R1) == THINK and thinking_switch(R1) is None
    assert detect_format(HARMONY) == GPT_OSS and thinking_switch(HARMONY) == "reasoning_effort"
    assert detect_format("{{ messages }}") == NONE and thinking_switch(None) is None


def test_start_state_from_the_prompt_tail():
    assert start_state(THINK, "<|im_start|>assistant\n<think>\n") == "reasoning"
    assert start_state(THINK, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "answer"
    # an earlier turn's closed block does not open one now
    assert start_state(THINK, "<think>a</think>b<|im_end|>\n<|im_start|>assistant\n") == "start"
    assert start_state(GPT_OSS, "<|start|>assistant") == "start"
