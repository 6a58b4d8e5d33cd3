"""What a caller asks a model for: typed prompts, and the one generation request that carries one.

These are the types of the request-level seam (engine.py's `Model.submit` takes a
`GenerationRequest`). They say what the caller means, not how an engine feeds it to a model:

* `TextPrompt`: plain text to continue;
* `TokenPrompt`: token ids of the model's own vocabulary (OpenAI's /v1/completions takes a list);
* `ChatPrompt`: chat messages, rendered with the model's chat template (or a named one), with
  template variables (what an OpenAI-compatible server calls chat_template_kwargs); a message's
  content is text, or a sequence of parts: text and `ImagePart`s (images, in their place);
* `InfillPrompt`: fill-in-the-middle, the text before and after the cursor, the text typed at the
  cursor (`middle`) and context chunks from other files.

The local engine renders a chat with the model's template (chat.py), builds a fill-in-the-middle
prompt from the model's special tokens (fim.py) and tokenizes; the remote engine sends chat messages,
infill parts and text to the server's matching endpoint. What comes back (streams, token events,
results) is in generation.py.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequest
from .generation import PRIORITY_BATCH, ConfidenceConfig, SamplingParams, check_stops
from .grammars import check_size
from .options import (DRAFT_MAX, JSON_SCHEMA, LOGPROBS, MAX_TOKENS, MAX_TOTAL_TOKENS, N_INDENT, REASONING_BUDGET,
                      POOLING, SPECULATIVE, THINKING, check)

Message = dict[str, Any]

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


@dataclass(frozen=True, eq=False)
class ImagePart:
    """An image in a chat message: an encoded image file (`data`: PNG, JPEG, WebP, ... bytes) or
    decoded 8-bit RGB pixels (`rgb`, row by row, with `width` and `height`). images.py decodes and
    checks it; the model's projector resizes it as that model was trained to see images."""

    data: bytes | None = None
    rgb: bytes | None = None
    width: int = 0
    height: int = 0
    #: the data URL's or file's media type where one was given ("image/png"); only a label
    mime: str | None = None

    def check(self) -> None:
        if (self.data is None) == (self.rgb is None):
            raise InvalidRequest("An image part needs either encoded image bytes (data) or RGB pixels (rgb).")
        if self.data is not None:
            if not isinstance(self.data, (bytes, bytearray, memoryview)):
                raise InvalidRequest(f"An image's data must be bytes, got {type(self.data).__name__}.")
            if not len(self.data):
                raise InvalidRequest("The image is empty (0 bytes).")
            return
        if not isinstance(self.rgb, (bytes, bytearray, memoryview)):
            raise InvalidRequest(f"An image's rgb pixels must be bytes, got {type(self.rgb).__name__}.")
        for name in ("width", "height"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidRequest(f"The image's {name} must be a positive integer, got {v!r}.")
        if len(self.rgb) != self.width * self.height * 3:
            raise InvalidRequest(f"The image's rgb pixels hold {len(self.rgb)} bytes; a {self.width}x{self.height} "
                                 f"RGB image has {self.width * self.height * 3}.")

    def __repr__(self) -> str:
        what = f"{len(self.data)} bytes" if self.data is not None else f"{self.width}x{self.height} RGB"
        return f"ImagePart({what})"


Part = str | ImagePart


def content_parts(content: Any) -> tuple[Part, ...]:
    """A message's content as parts: text stays one part."""
    return (content,) if isinstance(content, str) else tuple(content)


def message_images(messages: Any) -> list[ImagePart]:
    """The images of chat messages, in order."""
    return [p for m in messages if not isinstance(m.get("content"), str)
            for p in m["content"] if isinstance(p, ImagePart)]


def message_text(content: Any, image_text: str = "") -> str:
    """A message's content as text, each image written as `image_text`."""
    if isinstance(content, str):
        return content
    return "".join(p if isinstance(p, str) else image_text for p in content)


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
        msgs = tuple(self.messages)
        # content parts as a tuple (a list from JSON would make the prompt unhashable and mutable)
        msgs = tuple({**m, "content": tuple(m["content"])} if isinstance(m, dict) and isinstance(
            m.get("content"), (list, tuple)) else m for m in msgs)
        object.__setattr__(self, "messages", msgs)
        object.__setattr__(self, "variables", dict(self.variables or {}))
        object.__setattr__(self, "tools", tuple(self.tools or ()))

    def check(self) -> None:
        if not self.messages:
            raise InvalidRequest("No chat messages given.")
        for i, m in enumerate(self.messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), (str, tuple)):
                raise InvalidRequest(f"A chat message needs string 'role' and 'content' (text, or text and image "
                                     f"parts): {str(m)[:200]!r}")
            for part in content_parts(m["content"]):
                if isinstance(part, ImagePart):
                    part.check()
                elif isinstance(part, str):
                    check_text(f"Message #{i}", part)
                else:
                    raise InvalidRequest(f"Message #{i} has a content part that is neither text nor an image: "
                                         f"{type(part).__name__}")
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
    #: Thinking models (runtime/options/ declares each: default, bounds, help). `max_tokens` counts the
    #: answer; `max_total_tokens` bounds reasoning and answer together.
    thinking: str = THINKING.default
    reasoning_budget: int | None = REASONING_BUDGET.default
    max_total_tokens: int | None = MAX_TOTAL_TOKENS.default
    #: Structured output: a JSON schema the answer follows, or a GBNF grammar (not both)
    json_schema: dict[str, Any] | None = JSON_SCHEMA.default
    grammar: str | None = None
    #: Speculative decoding for this request (runtime/options: SPECULATIVE, DRAFT_MAX); None = the model's
    speculative: str | None = None
    draft_max: int | None = None
    #: lines after the first must be indented at least this much, else the answer ends (options.N_INDENT)
    n_indent: int = N_INDENT.default
    #: a threading.Event the caller sets when it no longer wants the answer (an HTTP client that left
    #: while the request's grammar compiled): the compilation stops being waited for (grammars.py)
    abandoned: Any = field(default=None, compare=False, repr=False)

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
        for option in (THINKING, REASONING_BUDGET, MAX_TOTAL_TOKENS, JSON_SCHEMA, N_INDENT):
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
        check_size(self.json_schema, self.grammar)
        if self.sampling.ignore_eos and (self.grammar is not None or self.json_schema is not None):
            raise InvalidRequest("ignore_eos with a json_schema or grammar cannot work: a finished answer ends with "
                                 "the end-of-generation token the grammar allows. Leave one of them out.")
        check(SPECULATIVE.or_none(), self.speculative)
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


def embed_texts(texts: Iterable[Any], pooling: str) -> list[str]:
    """The texts of an embedding request as a list, or InvalidRequest for what no engine embeds: an
    item that is not text or not valid Unicode, an empty text, no text at all, an unknown pooling.
    The runtime checks these once, whatever engine runs the model; an engine checks only what needs
    its own knowledge (a text's tokens against its embedding context)."""
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InvalidRequest(f"Item #{i} to embed is a {type(t).__name__}, not text.")
        check_text(f"Item #{i} to embed", t)
        if not t:
            raise InvalidRequest(f"Item #{i} to embed is empty; embeddings need at least one token.")
    if not texts:
        raise InvalidRequest("Nothing to embed: give at least one text.")
    check(POOLING, pooling)   # the option's own check, as every surface reads it
    return texts


def prompt_texts(prompt: Prompt) -> list[str]:
    """The texts a prompt is made of, in order (for estimates where no tokenizer is at hand)."""
    if isinstance(prompt, TextPrompt):
        return [prompt.text]
    if isinstance(prompt, ChatPrompt):
        return [message_text(m.get("content", "")) for m in prompt.messages]
    if isinstance(prompt, InfillPrompt):
        return [c.text for c in prompt.chunks] + [prompt.prefix, prompt.middle, prompt.suffix]
    return []


def prompt_images(prompt: Prompt) -> list[ImagePart]:
    """The images of a prompt, in order (only chat prompts carry images)."""
    return message_images(prompt.messages) if isinstance(prompt, ChatPrompt) else []


__all__ = ["ChatPrompt", "ContextChunk", "DEFAULT_MAX_TOKENS", "GenerationRequest", "ImagePart", "InfillPrompt",
           "Message", "PROMPT_TYPES", "Part", "Prompt", "TextPrompt", "TokenPrompt", "check_text", "content_parts",
           "message_images", "message_text", "prompt_images", "prompt_texts"]
