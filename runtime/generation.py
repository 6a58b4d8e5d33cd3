"""What a caller gets back, and how it samples: sampling settings, presets, streams, token events,
results, and the text assembly (UTF-8, stop strings, confidence spans) both engines share.

These types carry no engine state, so the engine behind them (in-process llama.cpp, an
OpenAI-compatible server) can be swapped without touching nodes or the language server. The
requests themselves (typed prompts, GenerationRequest) are in requests.py.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import A3BError, Cancelled, InvalidRequest
from .options import CONFIDENCE_OPTIONS, SAMPLING_OPTIONS, check_fields
from .pieces import PieceText
from .stops import IndentStop, StopMatcher

#: a request's priority: batch work (nodes, embeddings, pruning) and what a person waits for (editors,
#: chat); the scheduler (local/scheduler.py) serves the interactive class first
PRIORITY_BATCH = 0
PRIORITY_INTERACTIVE = 10

DEFAULT_MARKER = "# Note: This part requires verification."

#: Bounds on a request's stop strings: how many, and how many characters in all. Matching costs time
#: in proportion to the generated text whatever their length (stops.py); the bounds keep what one
#: request makes the process hold small. One string of 1 MiB characters is within them.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1 << 20


def check_stops(stop) -> tuple[str, ...]:
    """`stop` as a tuple of stop strings, or InvalidRequest when it breaks the bounds above."""
    stop = tuple(stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"At most {MAX_STOP_STRINGS} stop strings are taken, got {len(stop)}.")
    if any(not isinstance(s, str) or not s for s in stop):
        raise InvalidRequest("Stop strings must be non-empty strings.")
    total = sum(map(len, stop))
    if total > MAX_STOP_CHARS:
        raise InvalidRequest(f"The stop strings have {total} characters; at most {MAX_STOP_CHARS} in all are taken.")
    return stop


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn. Each field's meaning, default and bounds: its Option in runtime/options/."""

    temperature: float = SAMPLING_OPTIONS["temperature"].default
    top_p: float = SAMPLING_OPTIONS["top_p"].default
    top_k: int = SAMPLING_OPTIONS["top_k"].default
    min_p: float = SAMPLING_OPTIONS["min_p"].default
    repeat_penalty: float = SAMPLING_OPTIONS["repeat_penalty"].default
    repeat_last_n: int = SAMPLING_OPTIONS["repeat_last_n"].default
    #: None draws a fresh seed per request (recorded in the result); an int is passed to the sampler.
    seed: int | None = SAMPLING_OPTIONS["seed"].default
    #: the end-of-generation tokens are never drawn (llama-server's ignore_eos)
    ignore_eos: bool = SAMPLING_OPTIONS["ignore_eos"].default
    #: the samplers in the order they apply (options.SAMPLERS); None: the default order
    samplers: tuple[str, ...] | None = SAMPLING_OPTIONS["samplers"].default

    def validate(self) -> None:
        check_fields(self, SAMPLING_OPTIONS)


#: Sampling presets. "code" follows the usual advice for code models: low temperature (0.2-0.35)
#: and a repeat penalty about 1.15, so completions neither wander nor loop.
PRESETS: dict[str, SamplingParams] = {
    "default": SamplingParams(),
    "greedy": SamplingParams(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0),
    "code": SamplingParams(temperature=0.25, top_p=0.9, top_k=40, min_p=0.05, repeat_penalty=1.15),
    "creative": SamplingParams(temperature=0.9, top_p=0.95, top_k=80, min_p=0.02, repeat_penalty=1.05),
    "precise": SamplingParams(temperature=0.1, top_p=0.9, top_k=20, min_p=0.1, repeat_penalty=1.1),
}


def preset(name: str, **overrides: Any) -> SamplingParams:
    try:
        base = PRESETS[name]
    except KeyError:
        raise InvalidRequest(f"Unknown sampling preset {name!r}; choose one of {', '.join(PRESETS)}") from None
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class ConfidenceConfig:
    """Entropy monitoring: N consecutive tokens above `threshold` nats form a low-confidence span.

    Entropy is measured on the model's own next-token distribution (softmax of the raw logits,
    temperature 1), so it describes the model's uncertainty, not the sampler's settings.
    """

    enabled: bool = True
    threshold: float = CONFIDENCE_OPTIONS["threshold"].default
    min_run: int = CONFIDENCE_OPTIONS["min_run"].default
    insert_marker: bool = False
    marker: str = DEFAULT_MARKER

    def validate(self) -> None:
        check_fields(self, CONFIDENCE_OPTIONS)


@dataclass
class LowConfidenceSpan:
    start: int          # character offsets into the returned text
    end: int
    text: str
    mean_entropy: float
    max_entropy: float
    n_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


#: TokenEvent.token of an event that is not a new token: the text held back for a possible stop
#: string, released when the generation ends.
NOT_A_TOKEN = -1


@dataclass
class TokenEvent:
    text: str          # the new text released by this token (may be "" while a stop string is pending)
    #: the sampled token's id; None where the engine does not know it (a remote server sends text),
    #: NOT_A_TOKEN for the held-back text released at the end
    token: int | None
    entropy: float | None
    #: with GenerationRequest.logprobs: the sampled token's text and log-probability, and the most
    #: likely alternatives as (text, log-probability), best first
    piece: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[str, float]] | None = None
    #: reasoning text released by this token (thinking models): a channel apart from `text`
    reasoning: str = ""

    @property
    def is_token(self) -> bool:
        """This event stands for one generated token (not the tail released at the end)."""
        return self.token != NOT_A_TOKEN


@dataclass
class GenerationResult:
    text: str
    #: the generated token ids; None where the engine does not know them (a remote server)
    tokens: list[int] | None
    finish_reason: str            # "stop" (EOS or stop string), "length", "cancelled", "error"
    n_prompt_tokens: int
    n_cached_prompt_tokens: int   # prompt tokens whose KV cache was reused
    seed: int
    spans: list[LowConfidenceSpan]
    entropies: list[float]
    time_to_first_token: float    # seconds from submit to first sampled token
    total_time: float
    decode_time: float            # seconds from first to last token
    #: tokens generated (the length of `tokens` where the engine knows them)
    n_tokens: int = -1
    #: the reasoning before the answer (thinking models), its low-confidence spans (offsets into it)
    #: and its tokens; `reasoning_closed_by`: "model", "budget" (the runtime closed it) or None
    reasoning: str = ""
    reasoning_spans: list[LowConfidenceSpan] = field(default_factory=list)
    n_reasoning_tokens: int = 0
    reasoning_closed_by: str | None = None
    #: what the runtime noticed about the request without refusing it (a thinking switch the
    #: template lacks, say)
    warnings: list[str] = field(default_factory=list)
    #: speculative decoding: tokens drafted, and how many of them the model accepted
    n_drafted_tokens: int = 0
    n_accepted_tokens: int = 0
    #: where the tokens were drawn: "backend" (llama.cpp's graph) or "cpu" (sampler_choice.py); "" unknown
    sampler: str = ""
    #: the answer ended at the context's end, before max_tokens (and max_total_tokens): finish_reason
    #: is "length", and the answer may be cut short (cut_by_context, the one rule every surface reports)
    context_full: bool = False

    def __post_init__(self):
        if self.n_tokens < 0:
            self.n_tokens = len(self.tokens or ())

    @property
    def tokens_per_second(self) -> float:
        return (self.n_tokens - 1) / self.decode_time if self.n_tokens > 1 and self.decode_time > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("entropies", "tokens")}
        d["spans"] = [s.as_dict() for s in self.spans]
        d["reasoning_spans"] = [s.as_dict() for s in self.reasoning_spans]
        d["tokens_per_second"] = self.tokens_per_second
        return d


def cut_by_context(finish_reason: str, n_answer: int, n_tokens: int, max_tokens: int,
                   max_total_tokens: int | None = None) -> bool:
    """Whether a generation ended because its context was full: it ended for length before
    `max_tokens` answer tokens (a thinking model's reasoning tokens are not the answer's) and before
    `max_total_tokens` tokens in all were made.

    The rule every surface follows: a prompt that leaves no room in the context is refused
    (PromptTooLong); any other request runs until max_tokens or the context's end, whichever comes
    first, and an answer cut by the context's end says so (GenerationResult.context_full)."""
    return (finish_reason == "length" and n_answer < max_tokens
            and (max_total_tokens is None or n_tokens < max_total_tokens))


def context_note(result: GenerationResult, n_ctx: int, n_ctx_name: str = "n_ctx",
                 max_tokens_name: str = "max_tokens") -> str:
    """What to tell a user whose answer the context's end cut (empty when it did not), naming the
    surface's own settings (the CLI's --n-ctx and --max-tokens, the nodes' n_ctx and max_new_tokens)."""
    if not result.context_full:
        return ""
    reasoning = f"{result.n_reasoning_tokens} reasoning + " if result.n_reasoning_tokens else ""
    return (f"the answer stopped because the context is full ({result.n_prompt_tokens} prompt + {reasoning}"
            f"{result.n_tokens - result.n_reasoning_tokens} answer tokens of {n_ctx_name} {n_ctx}), before "
            f"{max_tokens_name}; raise {n_ctx_name} for a longer answer.")


class TextAssembler:
    """Turns sampled tokens into released text: UTF-8 safe, stop-string aware, entropy spans.

    Text that could be the start of a stop string is held back until it cannot be, so a caller that
    streams never shows half of a stop string. Low-confidence spans are runs of at least `min_run`
    consecutive tokens whose entropy is above `threshold`; with `insert_marker`, the marker is
    inserted on its own line before the line where a span starts.
    """

    def __init__(self, stop: tuple[str, ...], confidence: ConfidenceConfig, n_indent: int = 0):
        self.stop = stop
        self._stops = StopMatcher(stop) if stop else None
        self._indent = IndentStop(n_indent) if n_indent > 0 else None
        self.conf = confidence
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = PieceText()    # all decoded text (without stop string)
        self.released = 0           # chars of the text already handed out
        self.stopped = False
        self.entropies: list[float] = []
        self._tok_offsets: list[tuple[int, int]] = []  # char span of each token in the text
        self.spans: list[LowConfidenceSpan] = []
        self._run_start: int | None = None

    @property
    def text(self) -> str:
        return str(self._text)

    def add(self, piece: bytes, entropy: float | None) -> str:
        return self.add_text(self._decoder.decode(piece), entropy)

    def add_text(self, text: str, entropy: float | None) -> str:
        """Decoded text of one token (with its entropy), or text of no token (entropy None): the text
        it releases. Nothing is added after a stop string."""
        if self.stopped:
            return ""
        start = len(self._text)
        self._text.append(text)
        if entropy is not None:   # offsets stay aligned with entropies: one each per measured token
            self._tok_offsets.append((start, len(self._text)))
            self.entropies.append(entropy)
            self._track(entropy)
        elif not text:
            return ""
        if self._stops is None and self._indent is None:
            return self._release(len(self._text))
        # A stop string is searched for only where it can end: in the new text (stops.py).
        hits = [h for h in (self._stops.feed(text, start) if self._stops else -1,
                            self._indent.feed(text, start) if self._indent else -1) if h >= 0]
        if hits:
            self._text.cut(min(hits))
            self.stopped = True
            return self._release(min(hits))
        end = len(self._text)
        return self._release(end - max(self._stops.hold if self._stops else 0,
                                       self._indent.hold(end) if self._indent else 0))

    def flush(self) -> str:
        out = self.add_text(self._decoder.decode(b"", final=True), None)
        self._close_run()
        return out + ("" if self.stopped else self._release(len(self._text)))

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        out = self._text.slice(self.released, upto)
        self.released = upto
        return out

    def _track(self, entropy: float) -> None:
        i = len(self.entropies) - 1
        if entropy > self.conf.threshold:
            if self._run_start is None:
                self._run_start = i
        else:
            self._close_run()

    def _close_run(self) -> None:
        if self._run_start is None:
            return
        a, b = self._run_start, len(self.entropies)
        if self.entropies and self.entropies[-1] <= self.conf.threshold:
            b -= 1
        self._run_start = None
        b = min(b, len(self._tok_offsets))  # the end-of-generation token has an entropy but no text
        if b - a >= self.conf.min_run:
            s, e = self._tok_offsets[a][0], self._tok_offsets[b - 1][1]
            s, e = min(s, len(self._text)), min(e, len(self._text))
            ents = self.entropies[a:b]
            if e > s:
                self.spans.append(LowConfidenceSpan(s, e, self._text.slice(s, e), sum(ents) / len(ents), max(ents),
                                                    b - a))

    def final_text(self) -> tuple[str, list[LowConfidenceSpan]]:
        """The full text and spans; with insert_marker, markers inserted and span offsets shifted."""
        if not (self.conf.insert_marker and self.spans):
            return self.text, self.spans
        text, shift, spans = self.text, 0, []
        inserted_at: set[int] = set()
        for sp in self.spans:
            line_start = text.rfind("\n", 0, sp.start + shift) + 1
            if line_start not in inserted_at:
                ins = self.conf.marker + "\n"
                text = text[:line_start] + ins + text[line_start:]
                inserted_at.add(line_start)
                shift += len(ins)
            spans.append(LowConfidenceSpan(sp.start + shift, sp.end + shift, sp.text, sp.mean_entropy,
                                           sp.max_entropy, sp.n_tokens))
        return text, spans


__all__ = [
    "A3BError", "Cancelled", "ConfidenceConfig", "GenerationResult", "LowConfidenceSpan",
    "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "NOT_A_TOKEN", "PRESETS", "PRIORITY_BATCH", "PRIORITY_INTERACTIVE",
    "SamplingParams", "TextAssembler", "TokenEvent", "check_stops", "context_note", "cut_by_context", "preset",
]
