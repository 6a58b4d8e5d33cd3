"""What a caller asks a model for: typed prompts, and the one generation request that carries one.

These are the types of the request-level seam (engine.py's `Model.submit` takes a
`GenerationRequest`). They say what the caller means, not how an engine feeds it to a model:

* `TextPrompt`: plain text to continue;
* `TokenPrompt`: token ids of the model's own vocabulary (OpenAI's /v1/completions takes a list);
* `ChatPrompt`: chat messages, rendered with the model's chat template (or a named one), with
  template variables (what an OpenAI-compatible server calls chat_template_kwargs);
* `InfillPrompt`: fill-in-the-middle, the text before and after the cursor, the text typed at the
  cursor (`middle`) and context chunks from other files.

The local engine renders a chat with the model's template (chat.py), builds a fill-in-the-middle
prompt from the model's special tokens (fim.py) and tokenizes; the remote engine sends chat messages,
infill parts and text to the server's matching endpoint. What comes back (streams, token events,
results) is in generation.py.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequest
from .generation import ConfidenceConfig, SamplingParams, check_stops
from .options import DRAFT_MAX, JSON_SCHEMA, LOGPROBS, MAX_TOKENS, MAX_TOTAL_TOKENS, REASONING_BUDGET, THINKING, check
from .scheduler import PRIORITY_BATCH
from .speculative import parse_mode

Message = dict[str, str]

#: Tokens generated when a caller does not say (the max_tokens option's default).
DEFAULT_MAX_TOKENS = MAX_TOKENS.default

#: Names a chat template is already given: template variables may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                                "strftime_now", "functions", "function_call", "tools", "tool_choice"})


@dataclass(frozen=True)
class TextPrompt:
    """Plain text for the model to continue."""

    text: str
    #: begin with the BOS token where the model's tokenizer wants one
    add_bos: bool = True
    #: text such as "<|im_end|>" becomes that special token; off for text a user did not write as
    #: a prompt (a document), so that it cannot inject control tokens. A remote server tokenizes
    #: on its own terms: this reaches only the local engine.
    parse_special: bool = True

    def check(self) -> None:
        if not isinstance(self.text, str):
            raise InvalidRequest(f"The prompt must be text, got {type(self.text).__name__}.")
        if not self.text:
            raise InvalidRequest("The prompt is empty; give some text to continue.")
        check_text("The prompt", self.text)


@dataclass(frozen=True)
class TokenPrompt:
    """Token ids of the model's own vocabulary (the local model checks them against it)."""

    tokens: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(self.tokens))

    def check(self) -> None:
        if not self.tokens:
            raise InvalidRequest("The prompt tokenizes to nothing; give some text to continue.")
        bad = [t for t in self.tokens if isinstance(t, bool) or not isinstance(t, int)]
        if bad:
            raise InvalidRequest(f"Token ids must be integers, got {bad[:5]!r}")


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages ({"role", "content"}), answered as the assistant's next message."""

    messages: tuple[Message, ...]
    #: a llama.cpp template name ("chatml", "llama3", ...) instead of the model's own template
    template: str | None = None
    #: variables rendered into the model's own (Jinja) template, e.g. {"enable_thinking": False}
    variables: Mapping[str, Any] = field(default_factory=dict)
    #: tools the model may call, as OpenAI declares them ({"type": "function", "function": {"name",
    #: "description", "parameters"}}), rendered by the model's own template
    tools: tuple[dict, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "messages", tuple(self.messages))
        object.__setattr__(self, "variables", dict(self.variables or {}))
        object.__setattr__(self, "tools", tuple(self.tools or ()))

    def check(self) -> None:
        if not self.messages:
            raise InvalidRequest("No chat messages given.")
        for i, m in enumerate(self.messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequest(f"A chat message needs string 'role' and 'content': {m!r}")
            check_text(f"Message #{i}", m["content"])
        if self.template is not None and not isinstance(self.template, str):
            raise InvalidRequest(f"The chat template must be a name, got {self.template!r}")
        for k in self.variables:
            if not isinstance(k, str) or not k.isidentifier():
                raise InvalidRequest(f"A chat template variable needs a name (letters, digits, _), got {k!r}")
            if k in RESERVED_VARIABLES:
                raise InvalidRequest(f"The chat template variable {k!r} is set by the runtime; choose another name.")
        if self.variables and self.template:
            raise InvalidRequest(f"Template variables need the model's own chat template; the named template "
                                 f"{self.template!r} takes none. Leave the template empty, or the variables out.")
        try:
            json.dumps(self.variables, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"Chat template variables must be plain JSON values ({e}).") from None
        for i, t in enumerate(self.tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or t.get("type", "function") != "function" \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise InvalidRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                     f"\"parameters\": ...}}}}, got {str(t)[:80]!r}")
        if self.tools and self.template:
            raise InvalidRequest("Tools are rendered by the model's own chat template; leave the template empty.")


@dataclass(frozen=True)
class ContextChunk:
    """Text from another file, put before the prefix of an InfillPrompt."""

    filename: str
    text: str


@dataclass(frozen=True)
class InfillPrompt:
    """Fill-in-the-middle: the model writes what goes between `prefix + middle` and `suffix`.

    `middle` is the text typed on the cursor's line when the caller keeps it apart (llama-server's
    `prompt` field); `chunks` are context from other files. How the parts become one prompt (and
    what a model without fill-in-the-middle tokens gets) is fim.py's job, or the remote server's.
    """

    prefix: str
    suffix: str = ""
    middle: str = ""
    chunks: tuple[ContextChunk, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "chunks", tuple(self.chunks))

    def check(self) -> None:
        for name in ("prefix", "suffix", "middle"):
            v = getattr(self, name)
            if not isinstance(v, str):
                raise InvalidRequest(f"The infill {name} must be text, got {type(v).__name__}.")
            check_text(f"The infill {name}", v)
        for i, c in enumerate(self.chunks):
            if not isinstance(c, ContextChunk) or not isinstance(c.filename, str) or not isinstance(c.text, str):
                raise InvalidRequest(f"Context chunk #{i} must be a ContextChunk with text filename and text.")
            check_text(f"Context chunk #{i}", c.text)


Prompt = TextPrompt | TokenPrompt | ChatPrompt | InfillPrompt
PROMPT_TYPES = (TextPrompt, TokenPrompt, ChatPrompt, InfillPrompt)


@dataclass
class GenerationRequest:
    """One generation: a prompt, how to sample, when to stop, how urgent it is, what to report.

    A plain string as `prompt` stands for `TextPrompt(string)`.
    """

    prompt: Prompt
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    priority: int = PRIORITY_BATCH
    confidence: ConfidenceConfig = field(default_factory=ConfidenceConfig)
    #: Log-probabilities to report with every token: None = none, N = the sampled token's and the N
    #: most likely alternatives' (what the OpenAI API calls logprobs / top_logprobs).
    logprobs: int | None = LOGPROBS.default
    #: Thinking models (options.py declares each: default, bounds, help). `max_tokens` counts the
    #: answer; `max_total_tokens` bounds reasoning and answer together.
    thinking: str = THINKING.default
    reasoning_budget: int | None = REASONING_BUDGET.default
    max_total_tokens: int | None = MAX_TOTAL_TOKENS.default
    #: Structured output: a JSON schema the answer follows, or a GBNF grammar (not both)
    json_schema: dict[str, Any] | None = JSON_SCHEMA.default
    grammar: str | None = None
    #: Speculative decoding for this request (options.py: SPECULATIVE, DRAFT_MAX); None = the model's
    speculative: str | None = None
    draft_max: int | None = None

    def __post_init__(self):
        if isinstance(self.prompt, str):
            self.prompt = TextPrompt(self.prompt)
        self.stop = tuple(self.stop)

    def validate(self) -> None:
        if not isinstance(self.prompt, PROMPT_TYPES):
            raise InvalidRequest(f"The prompt must be a TextPrompt, TokenPrompt, ChatPrompt or InfillPrompt, "
                                 f"got {type(self.prompt).__name__}.")
        self.prompt.check()
        check(MAX_TOKENS, self.max_tokens)
        check_stops(self.stop)
        check(LOGPROBS, self.logprobs)
        self.confidence.validate()
        self.sampling.validate()
        for option in (THINKING, REASONING_BUDGET, MAX_TOTAL_TOKENS, JSON_SCHEMA):
            check(option, getattr(self, option.name))
        if self.json_schema is not None:
            try:
                json.dumps(self.json_schema, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise InvalidRequest(f"json_schema must hold plain JSON values ({e}).") from None
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise InvalidRequest("grammar must be GBNF text.")
        if self.grammar is not None and self.json_schema is not None:
            raise InvalidRequest("Give a json_schema or a grammar, not both.")
        if self.speculative is not None:
            parse_mode(self.speculative)
        check(DRAFT_MAX.or_none(), self.draft_max)


def check_text(what: str, text: str) -> None:
    """InvalidRequest for text that is not valid Unicode (a lone surrogate, as a UTF-16 client or a
    careless decoder can produce), instead of a UnicodeEncodeError from deep inside tokenization."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{what} is not valid Unicode: {e.reason} at character {e.start} "
                             f"({text[max(0, e.start - 20):e.start]!r} ...). "
                             "Remove or replace that character.") from None


def prompt_texts(prompt: Prompt) -> list[str]:
    """The texts a prompt is made of, in order (for estimates where no tokenizer is at hand)."""
    if isinstance(prompt, TextPrompt):
        return [prompt.text]
    if isinstance(prompt, ChatPrompt):
        return [m.get("content", "") for m in prompt.messages]
    if isinstance(prompt, InfillPrompt):
        return [c.text for c in prompt.chunks] + [prompt.prefix, prompt.middle, prompt.suffix]
    return []


__all__ = ["ChatPrompt", "ContextChunk", "DEFAULT_MAX_TOKENS", "GenerationRequest", "InfillPrompt", "Message",
           "PROMPT_TYPES", "Prompt", "TextPrompt", "TokenPrompt", "check_text", "prompt_texts"]
