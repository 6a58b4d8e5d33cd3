"""What A3BGenerate does, as plain functions over the runtime: the prompt from the widgets, the
budget, the stream handed to ComfyUI's progress and streaming hooks, the notes beside the answer.
No ComfyUI import here (see core.py)."""
from __future__ import annotations

import json
import logging
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..runtime import ChatPrompt, ConfidenceConfig, GenerationResult, LoadSpec, SamplingParams, get_runtime
from ..runtime.options import MAX_TOKENS, REASONING_BUDGET, THINKING, wrap_seed
from ..runtime.generation import context_note
from ..runtime.errors import InvalidRequest, PromptTooLong
from . import router as noderouter
from .core import NodeError

log = logging.getLogger("a3b.nodes")


def parse_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    r"""Stop strings from a widget: one per line; \n and \t escapes allowed (a line "\n\n" stops at a blank line)."""
    if stop is None:
        return ()
    items = stop.splitlines() if isinstance(stop, str) else list(stop)
    out = []
    for s in items:
        if not isinstance(s, str):
            raise InvalidRequest(f"Stop strings must be text, got {type(s).__name__}.")
        s = s.replace("\\n", "\n").replace("\\t", "\t")
        if s.strip(" ") and s not in out:
            out.append(s)
    return tuple(out)


def build_prompt(prompt: str, context: str | None = None) -> str:
    prompt = prompt or ""
    if context and context.strip():
        return f"{context.strip()}\n\n{prompt.strip()}" if prompt.strip() else context.strip()
    return prompt


@dataclass
class GenerateHooks:
    """ComfyUI services while a generation runs; all optional."""

    on_text: Callable[[str, int], None] | None = None        # (new text, tokens so far)
    on_reasoning: Callable[[str, int], None] | None = None   # (new reasoning text, tokens so far)
    should_stop: Callable[[], bool] | None = None            # e.g. ComfyUI's interrupt flag
    poll_interval: float = 0.05


@dataclass
class Generated:
    text: str
    spans_json: str
    result: GenerationResult
    interrupted: bool = False
    ui: dict[str, Any] = field(default_factory=dict)
    reasoning: str = ""
    #: said to the user beside the answer (an empty answer after a reasoning that took every token)
    note: str = ""


def _pump(stream, events, hooks: GenerateHooks) -> None:
    """Hand streamed text to `hooks.on_text` and watch `hooks.should_stop` until the stream ends.

    `events` is filled by the stream's on_token callback. The flag is also polled while no token
    arrives (a long prompt being read), not only per token.
    """
    n = 0
    while True:
        try:
            ev = events.get(timeout=hooks.poll_interval)
        except queue.Empty:
            if stream.done and events.empty():  # the last event is queued before `done` is set
                return
            ev = None
        if hooks.should_stop is not None and not stream.cancelled and hooks.should_stop():
            stream.cancel("interrupted")
        if ev is None:
            continue
        if ev.is_token:
            n += 1
        if ev.reasoning and hooks.on_reasoning is not None:
            hooks.on_reasoning(ev.reasoning, n)
        if hooks.on_text is not None:
            hooks.on_text(ev.text, n)


def sampling_params(*, seed: int | None = 0, **settings: Any) -> SamplingParams:
    """The sampler settings of A3BGenerate's widgets. ComfyUI's seed widget goes up to 2**64 - 1
    when a workflow is edited by hand; llama.cpp takes 32 bits, so the seed wraps."""
    sp = SamplingParams(seed=None if seed is None else wrap_seed(int(seed)), **settings)
    sp.validate()
    return sp


def check_budget(spec: LoadSpec, prompt_tokens: int, max_new_tokens: int) -> None:
    """The runtime's rule for the context (generation.cut_by_context): a prompt that leaves no room
    for an answer is refused, saying what to change; a max_new_tokens beyond the room is not: the
    answer then ends at the context's end, and the result says so (context_note)."""
    if spec.n_ctx - prompt_tokens <= 0:
        raise PromptTooLong(f"The prompt has {prompt_tokens} tokens but the context holds {spec.n_ctx}. "
                            "Shorten it or raise n_ctx in A3BLoader.")


def generate(spec: LoadSpec, prompt: str, *, system: str | None = None, context: str | None = None,
             max_new_tokens: int = MAX_TOKENS.default, sampling: SamplingParams | None = None,
             stop: str | Sequence[str] | None = "", confidence_aware: bool = False,
             confidence_threshold: float = ConfidenceConfig.threshold,
             hooks: GenerateHooks | None = None, thinking: str = THINKING.default,
             reasoning_budget: int | None = REASONING_BUDGET.default,
             json_schema: str | dict | None = None, images: Sequence[Any] = ()) -> Generated:
    """Run one chat generation on the handle's model, streaming through `hooks`; `images` (image
    parts) go into the user message before its text.

    Raises Cancelled (with the partial result attached) when `hooks.should_stop` turns true: the
    stream is cancelled between two tokens.
    """
    text_in = build_prompt(prompt, context)
    if not text_in.strip():
        raise InvalidRequest("The prompt is empty: type a prompt (or connect a context) for A3BGenerate.")
    spec, decision = noderouter.resolve(spec, text_in)
    if not isinstance(spec, LoadSpec):
        raise NodeError(f"'model' must come from an A3BLoader node, got {type(spec).__name__}.")
    hooks = hooks or GenerateHooks()
    rt = get_runtime()
    from ..runtime import chat as chatmod

    msgs = chatmod.messages(text_in, system.strip() if system and system.strip() else None)
    if images:
        msgs[-1] = {**msgs[-1], "content": (*images, msgs[-1]["content"])}
    prompt = ChatPrompt(msgs)
    n_prompt = rt.count_tokens(prompt, model=spec)
    check_budget(spec, n_prompt, max_new_tokens)
    if reasoning_budget is None and thinking != "off" and rt.load(spec).runs_here:
        # a remote server decodes on its own and cannot close the block at a budget: it gets none
        reasoning_budget = room_for_reasoning(spec.n_ctx, n_prompt, max_new_tokens)
    sampling = sampling or SamplingParams()
    conf = (ConfidenceConfig(enabled=True, threshold=confidence_threshold, insert_marker=True)
            if confidence_aware else ConfidenceConfig(enabled=False))
    events: queue.SimpleQueue = queue.SimpleQueue()
    holder: list = []  # the stream, once submit() returned (a first token may come before)

    def on_token(ev) -> None:
        # Runs on the scheduler thread: read the stop flag (so the stream is cancelled between two
        # tokens) and queue the event. Progress and streaming run on the caller's thread (_pump).
        if holder and hooks.should_stop is not None and hooks.should_stop():
            holder[0].cancel("interrupted")
        events.put(ev)

    stream = rt.submit(prompt, model=spec, max_tokens=max_new_tokens, sampling=sampling,
                       stop=parse_stop(stop), confidence=conf, on_token=on_token, thinking=thinking,
                       reasoning_budget=reasoning_budget, json_schema=parse_schema(json_schema))
    holder.append(stream)
    try:
        _pump(stream, events, hooks)
    except BaseException:
        stream.cancel("caller failed")  # e.g. ComfyUI's progress hook raised: stop decoding now
        raise
    res = stream.result()  # raises Cancelled / ModelUnloaded with .partial
    spans = json.dumps([s.as_dict() for s in res.spans])
    note = " ".join(n for n in (reasoning_note(res), context_note(res, spec.n_ctx, "n_ctx", "max_new_tokens")) if n)
    if note:
        log.warning("a3b: %s", note)
    ui = {"text": [res.text], **({"note": [note]} if note else {})}
    if decision is not None:
        ui["route"] = [noderouter.describe(decision)]
    return Generated(res.text, spans, res, ui=ui, reasoning=res.reasoning, note=note)


#: tokens kept for closing the reasoning block (the end-of-thinking marker and the blank line after it;
#: a few with a real tokenizer, more with a byte-level one)
CLOSE_RESERVE = 32


def room_for_reasoning(n_ctx: int, prompt_tokens: int, max_new_tokens: int) -> int:
    """A3BGenerate's reasoning budget when none is set: what the context holds beyond the prompt and
    max_new_tokens of answer, so a thinking model that reasons at length still has room to answer."""
    return max(1, n_ctx - prompt_tokens - max_new_tokens - CLOSE_RESERVE)


def reasoning_note(res: GenerationResult) -> str:
    """What to tell a user whose thinking run ended without an answer because the reasoning took every
    token it had (empty when the run answered)."""
    if res.text.strip() or not res.n_reasoning_tokens or res.reasoning_closed_by == "model":
        return ""
    return (f"The reasoning used all {res.n_reasoning_tokens} tokens and no answer came; raise max_new_tokens "
            "or n_ctx, or set a smaller reasoning_budget (or thinking off).")


def parse_schema(schema: str | dict | None) -> dict | None:
    """A json_schema widget's text as a schema (empty: none), or NodeError saying what is wrong."""
    if schema is None or isinstance(schema, dict):
        return schema
    if not schema.strip():
        return None
    try:
        value = json.loads(schema)
    except json.JSONDecodeError as e:
        raise NodeError(f"json_schema is not JSON: {e.msg} at line {e.lineno}, column {e.colno}. Paste a JSON "
                        "schema, or leave it empty for free text.") from None
    if not isinstance(value, dict):
        raise NodeError("json_schema must be a JSON object (a schema such as {\"type\": \"array\", ...}).")
    return value


__all__ = [
    "GenerateHooks", "Generated", "build_prompt", "check_budget", "generate", "parse_schema", "parse_stop",
    "room_for_reasoning", "sampling_params",
]
