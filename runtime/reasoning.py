"""Reasoning kept apart from the answer: which format a model thinks in, and the streaming splitter.

Thinking models write a reasoning block before their answer. The formats recognised (the ones
llama.cpp's server parses for the models this pack is for):

* `think`: `<think>` ... `</think>` then the answer (Qwen3, Qwen3.5/3.6 and their fine-tunes,
  DeepSeek-R1 and its distills). Some templates open the block in the generation prompt (DeepSeek-R1,
  Qwen3 "thinking" variants), so the output starts inside it; with `enable_thinking=false` the Qwen
  templates write an empty block into the prompt instead. Which case applies is read from the tail of
  the rendered prompt, after the last assistant turn began.
* `gpt-oss`: OpenAI's harmony channels, `<|channel|>analysis<|message|>` ... `<|end|>` then
  `<|start|>assistant<|channel|>final<|message|>` ... ; the analysis channel is the reasoning.
* `none`: everything is the answer (a model whose template shows no reasoning markers).

The block is recognised only where it can begin: at the start of the output (leading whitespace
allowed), or already open from the prompt. After it closes, the rest is the answer for good, so a
`<think>` in a code sample or a `</think>` inside a string literal of the answer stays text.

`Splitter.feed` takes decoded text as it streams and releases (reasoning, answer) text; a tag split
across tokens is held back until it is known to be a tag or not, so no half tag is ever shown. Every
call does work linear in the text it is given (the held-back part is shorter than the longest
marker), so a long generation costs linear time in all.
"""
from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

from .generation import ConfidenceConfig, LowConfidenceSpan, TextAssembler

THINK, GPT_OSS, NONE = "think", "gpt-oss", "none"
FORMATS = (THINK, GPT_OSS, NONE)


@dataclass(frozen=True)
class Format:
    name: str
    #: what ends the reasoning when the runtime closes the block itself (a budget reached), as the
    #: model would write it (special tokens included)
    end_text: str


FORMAT_OF = {
    THINK: Format(THINK, "\n</think>\n\n"),
    GPT_OSS: Format(GPT_OSS, "<|end|><|start|>assistant<|channel|>final<|message|>"),
    NONE: Format(NONE, ""),
}

#: Template variables that switch thinking, in the order they are looked for in a template:
#: Qwen3's enable_thinking, DeepSeek-V3.1's thinking, gpt-oss's reasoning_effort (which can lower
#: but not switch off the reasoning).
SWITCHES = ("enable_thinking", "thinking", "reasoning_effort")
_SWITCH_RE = {name: re.compile(r"\b" + name + r"\b") for name in SWITCHES}


def detect_format(template: str | None) -> str:
    """The reasoning format a chat template shows: its markers decide (none when it has none)."""
    t = template or ""
    if "<|channel|>" in t:
        return GPT_OSS
    if "<think>" in t or "</think>" in t:
        return THINK
    return NONE


def thinking_switch(template: str | None) -> str | None:
    """The template variable that switches thinking, or None when the template has no switch."""
    t = template or ""
    return next((name for name in SWITCHES if _SWITCH_RE[name].search(t)), None)


def start_state(fmt: str, prompt: str) -> str:
    """Where the output of a rendered prompt starts: "reasoning" when the template opened the block
    in the generation prompt (its last `<think>` comes after its last `</think>`), "answer" when it
    wrote a closed block there (the prompt ends with `</think>`: thinking switched off), else
    "start" (the model may open a block). Only the prompt's tail is read."""
    if fmt != THINK:
        return "start"
    tail = prompt[-2048:]
    if tail.rstrip().endswith("</think>"):
        return "answer"
    return "reasoning" if tail.rfind("<think>") > tail.rfind("</think>") else "start"


# -- splitters -------------------------------------------------------------------------------------------
def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a marker (held back)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class Splitter:
    """Everything is the answer (format `none`)."""

    def __init__(self):
        #: the answer channel has begun: what comes now is answer text
        self.answering = True
        #: a reasoning block was opened (by the prompt or the model)
        self.opened = False

    @property
    def in_reasoning(self) -> bool:
        return False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) text released by `text`."""
        return "", text

    def flush(self) -> tuple[str, str]:
        """What is still held back, at the end of the generation."""
        return "", ""


class ThinkSplitter(Splitter):
    """`<think>` ... `</think>` at the start of the output, or from the prompt on when it opened the block."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, start: str = "start"):
        super().__init__()
        self._state = start     # start, reasoning, answer
        self.answering = start == "answer"
        self.opened = start == "reasoning"
        self._buf = ""
        self._lead = True       # strip whitespace at the start of the reasoning / of the answer
        self._ws = ""           # trailing whitespace of the reasoning, released once text follows it

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, answer = "", ""
        while True:
            buf = self._buf
            if self._state == "start":
                rest = buf.lstrip()
                if rest.startswith(self.OPEN):
                    self._buf = rest[len(self.OPEN):]
                    self._state, self.opened, self._lead = "reasoning", True, True
                    continue
                if self.OPEN.startswith(rest):   # nothing yet, or part of the tag: wait
                    return reasoning, answer
                self._state, self.answering, self._lead = "answer", True, False
                continue
            if self._state == "reasoning":
                at = buf.find(self.CLOSE)
                upto = at if at >= 0 else len(buf) - _held(buf, (self.CLOSE,))
                reasoning += self._reason(buf[:upto])
                if at < 0:
                    self._buf = buf[upto:]
                    return reasoning, answer
                self._buf = buf[at + len(self.CLOSE):]
                self._ws = ""   # the whitespace before the tag is not part of the reasoning
                self._state, self.answering, self._lead = "answer", True, True
                continue
            self._buf = ""
            if self._lead:
                buf = buf.lstrip()
                if not buf:
                    return reasoning, answer
                self._lead = False
            return reasoning, answer + buf

    def _reason(self, text: str) -> str:
        """Reasoning text to release: leading whitespace dropped, trailing whitespace held."""
        if self._lead:
            text = text.lstrip()
            if not text:
                return ""
            self._lead = False
        body = text.rstrip()
        if not body:
            self._ws += text
            return ""
        out, self._ws = self._ws + body, text[len(body):]
        return out

    def flush(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == "reasoning":
            return self._reason(buf) if buf.strip() else "", ""
        if self._state == "start":   # a prefix of <think> and no more: it was text
            self._state, self.answering = "answer", True
            return "", buf.lstrip()
        return "", buf.lstrip() if self._lead else buf


class HarmonySplitter(Splitter):
    """gpt-oss's channels: headers (`<|start|>assistant<|channel|>NAME ... <|message|>`) are dropped;
    messages on the analysis channel are reasoning, on the others (final, commentary) the answer;
    `<|end|>`, `<|return|>` and `<|call|>` end a message."""

    MESSAGE, ENDS, HEADS = "<|message|>", ("<|end|>", "<|return|>", "<|call|>"), ("<|start|>", "<|channel|>")
    #: a header longer than this without <|message|> is text, not a header (nothing is held unbounded)
    MAX_HEADER = 256

    def __init__(self):
        super().__init__()
        self.answering = False
        self._state = "start"     # start, header, message
        self._channel = ""
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state == "message" and self._channel == "analysis"

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        out = ["", ""]
        while self._buf:
            buf = self._buf
            if self._state == "start":
                if any(buf.startswith(h) for h in self.HEADS):
                    self._state = "header"
                    continue
                if any(h.startswith(buf) for h in self.HEADS):
                    break
                self._begin("final")
                continue
            if self._state == "header":
                at = buf.find(self.MESSAGE)
                if at < 0:
                    if len(buf) > self.MAX_HEADER:
                        self._begin("final")
                        continue
                    break
                head, self._buf = buf[:at], buf[at + len(self.MESSAGE):]
                name = head.partition("<|channel|>")[2].split("<|", 1)[0].split()
                self._begin(name[0] if name else "final")
                continue
            hits = [(i, m) for m in self.ENDS + self.HEADS if (i := buf.find(m)) >= 0]
            at, marker = min(hits) if hits else (-1, "")
            upto = at if at >= 0 else len(buf) - _held(buf, self.ENDS + self.HEADS)
            out[self._channel != "analysis"] += buf[:upto]
            if at < 0:
                self._buf = buf[upto:]
                break
            self._buf = buf[at + (len(marker) if marker in self.ENDS else 0):]
            self._state = "header"
        return out[0], out[1]

    def _begin(self, channel: str) -> None:
        self._state, self._channel = "message", channel
        if channel == "analysis":
            self.opened = True
        else:
            self.answering = True

    def flush(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == "message":
            return (buf, "") if self._channel == "analysis" else ("", buf)
        return "", ""   # an unfinished header carries no text


def splitter(fmt: str, start: str = "start") -> Splitter:
    if fmt == THINK:
        return ThinkSplitter(start)
    if fmt == GPT_OSS:
        return HarmonySplitter()
    return Splitter()


# -- assembly of both channels -----------------------------------------------------------------------------
class ChannelAssembler:
    """Sampled tokens to released reasoning and answer text, for either engine.

    Bytes are decoded (UTF-8 safe) and split into the two channels; each channel has its own
    TextAssembler, so the answer's stop strings and low-confidence spans concern the answer alone
    (the reasoning gets spans of its own and no stop strings). A token's entropy counts in the
    channel its text went to. Tokens are counted per channel: `n_reasoning` are those read inside
    the block (its closing tag included), so a budget of N closes it after N of them.
    """

    def __init__(self, fmt: str, stop: tuple[str, ...], confidence: ConfidenceConfig, start: str = "start",
                 n_indent: int = 0):
        self.format = FORMAT_OF[fmt]
        self.split = splitter(fmt, start)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.answer = TextAssembler(stop, confidence, n_indent)
        self.reasoning = TextAssembler((), confidence)
        self.n_reasoning = 0
        self.n_answer = 0
        #: how the block ended: "model", "budget" (the runtime closed it), or None (never closed)
        self.closed_by: str | None = None

    @property
    def in_reasoning(self) -> bool:
        return self.split.in_reasoning

    @property
    def stopped(self) -> bool:
        return self.answer.stopped

    @property
    def entropies(self) -> list[float]:
        return self.answer.entropies

    def add(self, piece: bytes, entropy: float | None, markup: str = "") -> tuple[str, str]:
        """One sampled token (its bytes; `markup`: the text of a control token that renders as
        nothing, which only the splitter reads): the (reasoning, answer) text it releases."""
        was = self.split.in_reasoning
        r, a = self.split.feed(self._decoder.decode(piece) + markup)
        if was:
            self.n_reasoning += 1
            if not self.split.in_reasoning:
                self.closed_by = self.closed_by or "model"
        elif not self.split.in_reasoning and self.split.answering:
            self.n_answer += 1
        to_answer = bool(a) or (not r and not self.split.in_reasoning)
        out_r = self.reasoning.add_text(r, None if to_answer else entropy)
        out_a = self.answer.add_text(a, entropy if to_answer else None)
        return out_r, out_a

    def add_reasoning(self, text: str, entropy: float | None) -> str:
        """Reasoning a remote server already split off (its `reasoning_content`)."""
        self.n_reasoning += 1
        self.split.opened = True
        return self.reasoning.add_text(text, entropy)

    def close(self) -> tuple[str, str]:
        """Close the block as the runtime (a budget reached): the end text goes through the splitter
        like the model's own; the caller feeds the same text to the model as tokens."""
        r, a = self.split.feed(self.format.end_text)
        self.closed_by = "budget"
        return self.reasoning.add_text(r, None), self.answer.add_text(a, None)

    def flush(self) -> tuple[str, str]:
        """The held-back text of both channels, at the end."""
        r, a = self.split.feed(self._decoder.decode(b"", final=True))
        fr, fa = self.split.flush()
        r2, a2 = self.reasoning.add_text(r + fr, None), self.answer.add_text(a + fa, None)
        return r2 + self.reasoning.flush(), a2 + self.answer.flush()

    def final(self) -> tuple[str, list[LowConfidenceSpan], str, list[LowConfidenceSpan]]:
        """(answer, its spans, reasoning, its spans)."""
        text, spans = self.answer.final_text()
        reasoning, rspans = self.reasoning.final_text()
        return text, spans, reasoning, rspans


__all__ = ["ChannelAssembler", "FORMATS", "FORMAT_OF", "Format", "GPT_OSS", "HarmonySplitter", "NONE", "SWITCHES",
           "Splitter", "THINK", "ThinkSplitter", "detect_format", "splitter", "start_state", "thinking_switch"]
