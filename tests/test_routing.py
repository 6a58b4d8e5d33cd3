"""Routing by task type (runtime/routing.py, `a3b serve --route`) over the fake engine (fast tier): the
rules, the route table's refusals at start-up, and the decision in both APIs' answers and the log.
"""
from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

CODER = "fake://coder?text=CODE+"
TALKER = "fake://talker?text=PROSE+"
FENCED = "Why does this fail?\n```python\ndef add(a, b):\n    return a + b\n```"


# -- the rules -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, least", [
    (FENCED, 3), ("Fix the import error in src/app.py and tests/test_app.py", 2),
    ("Traceback (most recent call last): KeyError: 'x'", 2), ("SELECT name FROM users WHERE id = 1;", 1),
    ("Write a Python function that reverses a linked list", 3),
])
def test_code_signs_are_found(text, least):
    from comfyui_a3b.runtime.routing import code_signs

    assert len(code_signs(text)) >= least, code_signs(text)


@pytest.mark.parametrize("text", ["What should I see in Lisbon in two days?", "Write a poem about the sea.",
                                  "My grandmother turns ninety next week: ideas for a card?"])
def test_prose_has_few_code_signs(text):
    from comfyui_a3b.runtime.routing import code_signs

    assert len(code_signs(text)) < 2


@pytest.mark.parametrize("text", ["a" * 1_000_000, "a." * 500_000, "x_" * 500_000 + ".p", "`" * 1_000_000,
                                  "-" * 1_000_000 + ">"], ids=lambda text: f"{text[:4]!r}x{len(text)}")
def test_the_rules_are_linear_in_the_text(text):
    from comfyui_a3b.runtime.routing import code_signs

    t0 = time.perf_counter()
    code_signs(text)
    assert time.perf_counter() - t0 < 5   # a quadratic scan of a megabyte would take hours


# -- the table, at start-up ----------------------------------------------------------------------------------
def test_a_bad_table_is_refused_when_it_is_built(rt, fake_engine):
    from comfyui_a3b.runtime.errors import InvalidRequest, ModelNotFound
    from comfyui_a3b.runtime.routing import Router, parse_route
    from comfyui_a3b.serve.routed import build_router

    a = rt.spec(CODER)
    with pytest.raises(InvalidRequest, match="empty"):
        Router(rt, {})
    with pytest.raises(InvalidRequest, match="default"):
        Router(rt, {"code": a})
    with pytest.raises(InvalidRequest, match="math"):
        Router(rt, {"math": a, "default": a})   # a route of its own name needs its examples
    with pytest.raises(InvalidRequest, match="poetry"):
        Router(rt, {"code": a, "default": a}, examples={"poetry": ["a poem"]})
    with pytest.raises(InvalidRequest, match="NAME=MODEL"):
        parse_route("code")
    with pytest.raises(ModelNotFound):
        build_router(rt, a, ["code=no-such-model.gguf", f"default={TALKER}"])


def test_the_cli_refuses_a_bad_table_before_serving(capsys, fake_engine):
    from comfyui_a3b.cli import main

    assert main(["serve", "--http", "127.0.0.1:0", "--route", "code=no-such-model.gguf", "--route",
                 f"default={TALKER}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no-such-model" in err and len(err.splitlines()) == 1
    assert main(["serve", "--http", "127.0.0.1:0", "--route-examples", "/nonexistent.json"]) == 2
    assert main(["serve", "--http", "127.0.0.1:0", "--route", f"code={CODER}"]) == 2
    assert "default" in capsys.readouterr().err


# -- served ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def routed(fake_engine):
    from comfyui_a3b.runtime import get_runtime
    from comfyui_a3b.serve import Server
    from comfyui_a3b.serve.routed import build_router

    rt = get_runtime()
    base = rt.spec(TALKER, n_parallel=2, n_ctx=512)
    router = build_router(rt, base, [f"code={CODER}", f"default={TALKER}"], embedding="model")
    srv = Server(router.routes["default"], "127.0.0.1", 0, router=router).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=20, trust_env=False) as c:
            yield c, srv, rt
    finally:
        srv.stop()
        rt.unload()


def test_a_code_request_goes_to_the_code_model_in_both_apis(routed, caplog):
    c, srv, rt = routed
    caplog.set_level(logging.INFO, logger="a3b.route")
    ask = [{"role": "user", "content": FENCED}]
    r = c.post("/api/chat", json={"model": "auto", "messages": ask, "stream": False,
                                  "options": {"num_predict": 5, "temperature": 0}})
    assert r.status_code == 200, r.text
    route = r.json()["a3b"]["route"]
    assert route["route"] == "code" and route["method"] == "rules" and route["model"] == srv.cfg.router.names["code"]
    assert r.json()["message"]["content"].startswith("CODE") and r.headers["x-a3b-route"].startswith("code;")
    assert any("route code -> " in m for m in caplog.messages)
    r = c.post("/v1/chat/completions", json={"model": "auto", "messages": ask, "max_tokens": 5, "temperature": 0})
    assert r.json()["a3b"]["route"]["route"] == "code" and r.json()["model"] == "auto"
    assert r.json()["choices"][0]["message"]["content"].startswith("CODE")
    # streamed: the decision rides in the last line (Ollama) and the last chunk's a3b block (OpenAI)
    r = c.post("/api/generate", json={"model": "auto", "prompt": FENCED, "options": {"num_predict": 3}})
    assert json.loads(r.text.splitlines()[-1])["a3b"]["route"]["route"] == "code"
    r = c.post("/v1/chat/completions", json={"model": "auto", "messages": ask, "max_tokens": 3, "stream": True})
    chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    assert chunks[-1]["a3b"]["route"]["route"] == "code"


def test_prose_is_embedded_and_the_chosen_model_answers(routed):
    c, srv, rt = routed
    r = c.post("/api/chat", json={"model": "auto", "messages": [{"role": "user", "content": "Plan a picnic."}],
                                  "stream": False, "options": {"num_predict": 5, "temperature": 0}})
    route = r.json()["a3b"]["route"]
    assert route["method"] == "model"
    assert r.json()["message"]["content"].startswith("CODE" if route["route"] == "code" else "PROSE")


def test_each_model_is_served_by_name_too_and_listed(routed):
    c, srv, rt = routed
    names = [m["name"] for m in c.get("/api/tags").json()["models"]]
    coder = srv.cfg.router.names["code"]
    assert {"auto:latest", coder + ":latest", srv.cfg.router.names["default"] + ":latest"} <= set(names)
    r = c.post("/api/generate", json={"model": coder, "prompt": "Plan a picnic.", "stream": False,
                                      "options": {"num_predict": 3, "temperature": 0}})
    assert r.json()["response"] == "COD" and "a3b" not in r.json()
    paths = [e.spec.path for e in rt.store.loaded()]   # other tests may have left the embedded model loaded
    assert all(paths.count(spec.path) == 1 for spec in srv.cfg.router.routes.values())
