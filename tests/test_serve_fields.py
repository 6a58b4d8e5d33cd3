"""Request fields that change the answer: honoured (ignore_eos, repeat_last_n) or refused with a 400
naming them, never dropped (fast tier: `a3b serve` over the fake engine)."""
from __future__ import annotations

import json

import httpx
import pytest

from serve_helpers import TOKEN

#: a model that ends with EOS after 9 tokens
MODEL = "fake://eosy?eos_after=9&delay_ms=1"


@pytest.fixture(scope="module")
def eosy(fake_engine):
    from comfyui_a3b.runtime import get_runtime
    from comfyui_a3b.serve import Server

    srv = Server(get_runtime().spec(MODEL, n_parallel=2, n_ctx=256), "127.0.0.1", 0, token=TOKEN,
                 name="eosy").start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=20, trust_env=False) as c:
            yield c
    finally:
        srv.stop()


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_ignore_eos_generates_exactly_max_tokens(eosy, path, body):
    plain = eosy.post(path, json={**body, "max_tokens": 48, "temperature": 0}).json()
    assert plain["usage"]["completion_tokens"] == 9 and plain["choices"][0]["finish_reason"] == "stop"
    r = eosy.post(path, json={**body, "max_tokens": 48, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 48 and r.json()["choices"][0]["finish_reason"] == "length"
    streamed = eosy.post(path, json={**body, "max_tokens": 30, "temperature": 0.7, "seed": 1, "ignore_eos": True,
                                     "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(ln[6:]) for ln in streamed.text.splitlines() if ln.startswith("data: {")]
    assert [e["usage"]["completion_tokens"] for e in events if e.get("usage")] == [30]


@pytest.mark.parametrize("field,value", [("ignore_eos", "yes"), ("ignore_eos", 1), ("repeat_last_n", -2)])
def test_a_bad_value_is_a_400_naming_the_field(eosy, field, value):
    r = eosy.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"]


def test_ignore_eos_with_a_grammar_is_refused(eosy):
    r = eosy.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "ignore_eos": True,
                                           "grammar": 'root ::= "a"'})
    assert r.status_code == 400 and "ignore_eos" in r.json()["error"]["message"]


@pytest.mark.parametrize("field,value", [("presence_penalty", 0.5), ("frequency_penalty", 1), ("logit_bias", {"5": 3}),
                                         ("mirostat", 2), ("typical_p", 0.5), ("echo", True),
                                         ("dry_multiplier", 0.8), ("xtc_probability", 0.5), ("best_of", 3)])
def test_a_field_this_server_does_not_honour_is_a_400_naming_it(eosy, field, value):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = eosy.post(path, json={**body, "max_tokens": 4, field: value})
        assert r.status_code == 400, (path, field, r.text)
        assert field in r.json()["error"]["message"]


def test_neutral_values_of_those_fields_pass(eosy):
    r = eosy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                                "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                                                "echo": False, "typical_p": 1.0, "mirostat": 0})
    assert r.status_code == 200, r.text


def test_n_probs_gives_llama_servers_probabilities_on_infill_and_is_refused_in_a_chat(eosy):
    r = eosy.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 3, "n_probs": 2,
                                   "temperature": 0, "stream": True})
    probs = [p for ln in r.text.splitlines() if ln.startswith("data: {")
             for p in json.loads(ln[6:]).get("completion_probabilities", [])]
    assert len(probs) == 3 and all(len(p["top_logprobs"]) == 2 for p in probs)
    r = eosy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n_probs": 2})
    assert r.status_code == 400 and "n_probs" in r.json()["error"]["message"]


def test_samplers_is_checked_by_name(eosy):
    for bad in (["top_k", "xtc"], ["top_k", "top_k"], "kpt", [1]):
        r = eosy.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "samplers": bad})
        assert r.status_code == 400 and "samplers" in r.json()["error"]["message"], bad
    r = eosy.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "samplers": ["top_k", "top_p", "infill"]})
    assert r.status_code == 200, r.text


def test_n_indent_ends_the_answer_at_the_first_line_indented_less(fake_engine):
    from comfyui_a3b.runtime import get_runtime

    rt = get_runtime()
    model = "fake://indent?text=x%20%3D%201%0A%20%20%20%20y%0A%20%20%20%20z%0Aw%0A"   # "x = 1\n    y\n    z\nw\n"
    free = rt.generate("a", model=model, chat=False, max_tokens=40, sampling=rt_greedy())
    assert "\nw\n" in free.text
    cut = rt.generate("a", model=model, chat=False, max_tokens=40, sampling=rt_greedy(), n_indent=4)
    assert cut.text == "x = 1\n    y\n    z\n" and cut.finish_reason == "stop"
    streamed: list[str] = []
    rt.generate("a", model=model, chat=False, max_tokens=40, sampling=rt_greedy(), n_indent=4,
                on_token=lambda ev: streamed.append(ev.text))
    assert "".join(streamed) == cut.text   # the line indented too little is never streamed


def rt_greedy():
    from comfyui_a3b.runtime import preset

    return preset("greedy")


def test_confidence_spans_only_when_asked(eosy):
    body = {"prompt": "x9", "max_tokens": 6, "temperature": 0}
    plain = eosy.post("/v1/completions", json=body).json()
    assert plain["a3b"]["low_confidence_spans"] == []
    asked = eosy.post("/v1/completions", json={**body, "confidence": {"threshold": 1.0, "min_run": 1}}).json()
    assert len(asked["a3b"]["low_confidence_spans"]) == 1   # the token after the digit: the fake is unsure there
    for bad in ({"threshold": -1}, {"colour": 1}, "yes"):
        r = eosy.post("/v1/completions", json={**body, "confidence": bad})
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and ("confidence" in msg or "threshold" in msg), r.text
