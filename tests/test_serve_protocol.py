"""serve/protocol/: each request field declared once (against the runtime's Option where it has
one), every field an endpoint reads declared, and the body read once into a frozen typed request
that the handlers take (fast tier, no server)."""
from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from comfyui_a3b.runtime import options as opt
from comfyui_a3b.runtime.errors import InvalidRequest
from comfyui_a3b.serve import app, protocol
from comfyui_a3b.serve.protocol import FIELDS, NOT_HONOURED

MSGS = [{"role": "user", "content": "hi"}]


class Recording(dict):
    """A body that records the names read from it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


PARSERS = [(protocol.parse_chat, {"messages": MSGS, "max_tokens": 4, "logprobs": True}),
           (protocol.parse_completion, {"prompt": "x", "max_tokens": 4}),
           (protocol.parse_infill, {"input_prefix": "a", "max_tokens": 4}),
           (protocol.parse_embeddings, {"input": "x"}),
           (protocol.parse_tokenize, {"content": "x"})]


def test_every_field_read_is_declared_and_every_declared_field_is_read():
    read: set[str] = set()
    for parse, body in PARSERS:
        b = Recording(body)
        req = parse(b)
        assert dataclasses.is_dataclass(req) and type(req).__dataclass_params__.frozen
        with pytest.raises(dataclasses.FrozenInstanceError):
            req.model = "other"   # type: ignore[misc]
        read |= b.read
    undeclared = read - set(FIELDS) - set(NOT_HONOURED) - {a for f in FIELDS.values() for a in f.aliases}
    assert not undeclared, undeclared
    assert set(FIELDS) <= read, set(FIELDS) - read


def test_fields_take_bounds_and_help_from_the_runtime_options():
    declared = {id(o) for o in vars(opt).values() if isinstance(o, opt.Option)}
    with_option = [f for f in FIELDS.values() if f.option is not None]
    assert len(with_option) >= 15
    for f in with_option:
        assert id(f.option) in declared, f.name           # the runtime's own declaration, not a copy
        assert f.help == f.option.help
    for f in FIELDS.values():
        assert f.help, f.name
    # a bound of the declaration is the field's bound, named by the field's own name
    for name in ("max_tokens", "max_completion_tokens", "top_k", "draft_max", "n_indent", "reasoning_budget"):
        option = FIELDS[name].option
        bad = option.max + 1 if option.max is not None else option.min - 1
        with pytest.raises(InvalidRequest, match=re.escape(f"{name} must be {option.range_text()}")):
            protocol.parse_chat({"messages": MSGS, name: bad})


def test_the_typed_requests_carry_what_the_runtime_takes():
    chat = protocol.parse_chat({"messages": MSGS, "max_completion_tokens": 9, "max_tokens": 3, "temperature": 0.2,
                                "repetition_penalty": 1.3, "stop": "x", "reasoning_effort": "low", "seed": 2**32 + 5,
                                "response_format": {"type": "json_object"}, "stream": True,
                                "stream_options": {"include_usage": True}})
    s = chat.settings()
    assert (s["max_tokens"], s["sampling"].temperature, s["sampling"].repeat_penalty, s["sampling"].seed) == \
        (9, 0.2, 1.3, 5)
    assert (s["stop"], s["thinking"], s["json_schema"]) == (("x",), "on", {"type": "object"})
    assert chat.prompt.variables == {"reasoning_effort": "low"} and chat.gen.stream and chat.gen.include_usage
    text = protocol.parse_completion({"prompt": "x", "n_predict": 7, "grammar": "root ::= \"a\""})
    assert (text.settings()["max_tokens"], text.settings()["grammar"]) == (7, "root ::= \"a\"")
    assert protocol.parse_completion({"prompt": "x", "n_predict": -1}).gen.max_tokens == opt.MAX_TOKENS.default
    infill = protocol.parse_infill({"input_prefix": "a", "t_max_predict_ms": 250})
    assert (infill.gen.max_tokens, infill.deadline_s) == (opt.INFILL_N_PREDICT.default, 0.25)
    # not clamped to any context: the runtime ends the answer at the context's end and says so
    assert protocol.parse_completion({"prompt": "x", "max_tokens": opt.MAX_TOKENS.max}).gen.max_tokens == \
        opt.MAX_TOKENS.max


def test_the_handlers_read_no_body():
    assert "body" not in inspect.getsource(app.Api)
