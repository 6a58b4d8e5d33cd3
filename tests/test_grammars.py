"""Structured output's refusals and bounds (fast tier): keywords that cannot be enforced are named,
every one; a schema or grammar over A3B_GRAMMAR_MAX_BYTES or slower than A3B_GRAMMAR_TIMEOUT_S is
refused naming the bound, on every surface (runtime, HTTP 400, ComfyUI node, CLI exit 2); a caller
that leaves stops waiting for its compilation. The compiler is the real one (llguidance, without a
vocabulary); the fake model stands in for llama.cpp."""
from __future__ import annotations

import copy
import json
import threading
import time

import httpx
import pytest

from comfyui_a3b import cli
from comfyui_a3b.runtime import Cancelled, InvalidRequest, Runtime
from comfyui_a3b.runtime import grammars
from comfyui_a3b.runtime.llama.grammar import check_text, grammar_text

MODEL = "fake://gram?text={}&eos_after=2"
HOSTILE_ALTERNATIVES = "root ::= " + " | ".join(f'"w{i}x"' for i in range(50_000))


@pytest.fixture()
def rt(fake_engine):
    r = Runtime()
    yield r
    r.unload()


def engine_of(rt):
    return rt.load(MODEL).backend


def test_every_unsupported_keyword_is_named_with_where_it_is():
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "uniqueItems": True, "contains": {"type": "string"}},
        "when": {"type": "string", "format": "uri-reference"},
        "either": {"anyOf": [{"not": {"type": "null"}}, {"if": {}, "then": {}}]}},
        "$defs": {"d": {"propertyNames": {"pattern": "^a"}}}, "dependentRequired": {"a": ["b"]}}
    found = grammars.unsupported(schema)
    assert found == ["dependentRequired at (the root)", "uniqueItems at /properties/tags",
                     "contains at /properties/tags", "format 'uri-reference' at /properties/when",
                     "not at /properties/either/anyOf/0", "if at /properties/either/anyOf/1",
                     "then at /properties/either/anyOf/1", "propertyNames at /$defs/d"]
    with pytest.raises(InvalidRequest) as ei:
        grammars.check_schema(schema)
    for item in found:
        assert item in str(ei.value)


def test_what_is_enforced_or_only_annotates_passes_the_keyword_check():
    schema = {"title": "t", "description": "d", "$schema": "https://json-schema.org/draft/2020-12/schema",
              "type": "object", "required": ["n"], "additionalProperties": False, "properties": {
                  "n": {"type": "integer", "minimum": 1, "maximum": 10, "examples": [3], "default": 1},
                  "s": {"type": "string", "minLength": 2, "maxLength": 8, "pattern": "^[a-z]+$"},
                  "d": {"type": "string", "format": "date-time"}, "f": {"type": "number", "format": "float"},
                  "o": {"oneOf": [{"type": "null"}, {"$ref": "#/$defs/x"}]},
                  "a": {"type": "array", "minItems": 1, "maxItems": 3, "prefixItems": [{"const": 1}]}},
              "$defs": {"x": {"enum": ["a", "b"], "contentEncoding": "base64"}}}
    assert grammars.unsupported(schema) == []
    check_text("json_schema", grammar_text(schema, None))


def test_deep_schemas_are_walked_without_recursion():
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    schema["items"]["not"] = {}
    assert grammars.unsupported(schema) == ["not at /items"]


def test_objects_listing_properties_are_closed_as_llama_cpp_reads_them():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}},
              "anyOf": [{"properties": {"c": {}}}], "items": {"properties": {}, "additionalProperties": True}}
    before = copy.deepcopy(schema)
    out = grammars.closed_objects(schema)
    assert schema == before   # a copy
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False
    assert out["items"]["additionalProperties"] is True
    # with allOf, narrowing a branch or a definition it refers to could contradict another branch
    with_all = {"allOf": [{"$ref": "#/$defs/a"}, {"properties": {"b": {}}, "required": ["b"]}],
                "$defs": {"a": {"properties": {"a": {}}}}}
    assert grammars.closed_objects(with_all) == with_all
    assert "additionalProperties" not in grammars.closed_objects({"type": "object"})


@pytest.mark.parametrize("schema,match", [
    ({"type": "integer", "minimum": 5, "maximum": 1}, "does not compile"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "does not compile.*[Uu]nsatisfiable"),
    ({"type": "string", "pattern": "^(a$"}, "does not compile: regex parse error.*unclosed group"),
    ({"type": "strin"}, "does not compile.*strin"),
])
def test_schemas_that_cannot_hold_are_refused_on_one_line(rt, schema, match):
    with pytest.raises(InvalidRequest, match=match) as ei:
        rt.submit("Hi", model=MODEL, json_schema=schema)
    assert "\n" not in str(ei.value)


def test_size_bound_is_named(rt, monkeypatch):
    monkeypatch.setenv("A3B_GRAMMAR_MAX_BYTES", "1000")
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"json_schema is \d+ bytes; at most 1000 .*A3B_GRAMMAR_MAX_BYTES"):
        rt.submit("Hi", model=MODEL, json_schema={"enum": [f"value{i}" for i in range(1000)]})
    with pytest.raises(InvalidRequest, match=r"grammar is \d+ bytes; at most 1000 .*A3B_GRAMMAR_MAX_BYTES"):
        rt.submit("Hi", model=MODEL, grammar='root ::= "a"' + " " * 2000)
    assert time.monotonic() - t0 < 5


def test_the_issue_cases_are_refused_by_size_or_compile_at_once(rt):
    """An enum of 100 000 values and a grammar of 50 000 alternatives are over the default size; the
    huge bounds compile in no time (llguidance does not unroll them) and answer."""
    for kw in ({"json_schema": {"enum": [f"value{i}" for i in range(100_000)]}},
               {"grammar": HOSTILE_ALTERNATIVES}):
        with pytest.raises(InvalidRequest, match="A3B_GRAMMAR_MAX_BYTES"):
            rt.submit("Hi", model=MODEL, **kw)
    for schema in ({"type": "string", "minLength": 100_000_000},
                   {"type": "array", "minItems": 10_000_000, "items": {"type": "integer"}}):
        t0 = time.monotonic()
        assert rt.generate("Hi", model=MODEL, json_schema=schema, max_tokens=4).text is not None
        assert time.monotonic() - t0 < 10


def test_time_bound_is_named_and_frees_the_caller(rt, monkeypatch):
    engine_of(rt).compile_delay = 3.0
    monkeypatch.setenv("A3B_GRAMMAR_TIMEOUT_S", "0.2")
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"took longer than 0.2 s to compile \(A3B_GRAMMAR_TIMEOUT_S\)"):
        rt.submit("Hi", model=MODEL, json_schema={"type": "object"})
    assert time.monotonic() - t0 < 2.5


def test_a_caller_that_leaves_stops_waiting(rt):
    engine_of(rt).compile_delay = 3.0
    gone = threading.Event()
    threading.Timer(0.2, gone.set).start()
    t0 = time.monotonic()
    with pytest.raises(Cancelled, match="abandoned"):
        rt.submit("Hi", model=MODEL, json_schema={"type": "object"}, abandoned=gone)
    assert time.monotonic() - t0 < 2.0


def _idle_compilers(timeout: float = 10) -> bool:
    """Whether every compilation slot is free (an earlier test's slow compilations end on their own)."""
    deadline = time.monotonic() + timeout
    while grammars._pending._value < grammars.MAX_PENDING and time.monotonic() < deadline:
        time.sleep(0.02)
    return grammars._pending._value == grammars.MAX_PENDING


def test_compilations_in_flight_are_bounded():
    assert _idle_compilers()
    release = threading.Event()
    threads = [threading.Thread(target=grammars.compile_bounded, args=(release.wait,))
               for _ in range(grammars.MAX_PENDING)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 5
        while grammars._pending._value and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(InvalidRequest, match="compiling already"):
            grammars.compile_bounded(lambda: 1)
    finally:
        release.set()
        for t in threads:
            t.join(10)
    assert grammars.compile_bounded(lambda: 7) == 7


def test_bad_keywords_and_bounds_are_http_400(client, monkeypatch):
    schema = {"type": "object", "properties": {"a": {"not": {}}, "b": {"uniqueItems": True}}}
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "not at /properties/a" in msg and "uniqueItems at /properties/b" in msg
    r = client.post("/v1/completions", json={"prompt": "x", "grammar": HOSTILE_ALTERNATIVES})
    assert r.status_code == 400 and "A3B_GRAMMAR_MAX_BYTES" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "x", "grammar": "root ::= (unclosed"})
    assert r.status_code == 400 and "grammar does not parse" in r.json()["error"]["message"]


def test_a_client_leaving_while_its_grammar_compiles_is_noticed(server):
    """The client closes its connection while its grammar compiles (3 s here): the submit stops
    waiting at once (Cancelled) instead of holding a thread until the compiler ends."""
    from comfyui_a3b.runtime import get_runtime

    backend = get_runtime().load(server.cfg.spec).backend
    backend.compile_delay = 3.0
    n = len(backend.compile_errors)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"http://127.0.0.1:{server.port}/v1/completions", timeout=0.3, trust_env=False,
                       headers={"Authorization": "Bearer s3cret-token"},
                       json={"prompt": "x", "response_format": {"type": "json_object"}})
        left = time.monotonic()
        while len(backend.compile_errors) == n and time.monotonic() - left < 10:
            time.sleep(0.02)
        assert backend.compile_errors[n:][:1] and backend.compile_errors[n][0] == "Cancelled"
        assert backend.compile_errors[n][1] - left < 1.5   # not the 2.7 s the compilation had left
    finally:
        backend.compile_delay = 0.0


def test_node_and_cli_name_the_keywords(capsys, tmp_path, fake_engine):
    from comfyui_a3b.nodes.core import NodeError, load_model
    from comfyui_a3b.nodes.generation import generate

    bad = {"type": "array", "uniqueItems": True, "items": {"type": "string", "format": "regex"}}
    with pytest.raises((NodeError, InvalidRequest), match=r"uniqueItems at \(the root\).*format 'regex' at /items"):
        generate(load_model(MODEL), "Hi", json_schema=json.dumps(bad))
    f = tmp_path / "s.json"
    f.write_text(json.dumps(bad))
    code = cli.main(["generate", "Hi", "--model", MODEL, "--json-schema", str(f)])
    err = capsys.readouterr().err
    assert code == 2 and "uniqueItems at (the root)" in err and len(err.strip().splitlines()) == 1


def test_a_grammar_that_fails_while_answering_ends_its_own_request_only(rt):
    """A matcher over its per-token bounds ends that request with the error; a request batched beside
    it goes on to its end."""
    model = rt.spec("fake://gramfail?grammar_fail=3&delay_ms=2", n_parallel=2)
    bad = rt.submit("Hi", model=model, json_schema={"type": "string"}, max_tokens=20)
    good = rt.submit("Hi", model=model, max_tokens=12)
    with pytest.raises(InvalidRequest, match="fake grammar's step limit"):
        bad.result()
    res = good.result()
    assert res.finish_reason == "length" and res.n_tokens == 12


class _Matcher:
    """llguidance's LLMatcher as far as Grammar.pick uses it, failing at its first mask."""

    def __init__(self):
        self.err = ""

    def is_error(self):
        return bool(self.err)

    def is_stopped(self):
        return bool(self.err)

    def validate_tokens(self, tokens):
        return 0

    def compute_bitmask(self):
        self.err = "step lexer fuel exhausted"
        return b"\0" * 4

    def get_error(self):
        return self.err

    def stop_reason(self):
        return "LexerTooComplex"


def test_a_mask_over_its_bound_ends_the_answer_with_a_clear_error():
    import numpy as np

    from comfyui_a3b.runtime.llama.grammar import Grammar

    g = Grammar(_Matcher(), n_vocab=32, eos=7)
    assert g.pick(None, np.arange(32, dtype=np.float32), greedy=True) == 7
    assert "a token mask" in g.error and "step lexer fuel exhausted" in g.error
