"""Ollama's API and routing by task type on real parts (slow tier): `a3b serve` in this process on
the embedded model, with a route table whose code route is a tiny random-weight llama GGUF written
here (a second real model, loaded by llama.cpp), driven by the official `ollama` client and httpx.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import ollama
import pytest

from tinygguf import write_tiny_gguf

pytestmark = pytest.mark.slow

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CODE_ASK = "Why does this raise a KeyError?\n```python\ndef f(d):\n    return d['x']\n```"
PROSE_ASK = "Suggest a quiet place for a picnic near a lake."


@pytest.fixture(scope="module")
def routed(rt, default_path, tmp_path_factory):
    from comfyui_a3b.serve import Server
    from comfyui_a3b.serve.routed import build_router

    tiny = write_tiny_gguf(tmp_path_factory.mktemp("coder") / "tiny-coder.gguf", chat_template=CHATML)
    rt.unload()
    loads = rt.store.weight_loads
    base = rt.spec(None, n_parallel=2, n_ctx=512)
    router = build_router(rt, base, [f"code={tiny}", f"default={default_path}"])
    assert rt.store.weight_loads - loads == 2   # both models at start-up, once each
    srv = Server(router.routes["default"], "127.0.0.1", 0, router=router).start()
    try:
        yield srv, ollama.Client(host=f"http://127.0.0.1:{srv.port}"), loads
    finally:
        srv.stop()
        rt.unload()


def test_the_ollama_client_gets_the_embedded_models_answer(routed, rt):
    from comfyui_a3b.runtime import SamplingParams

    srv, oc, _ = routed
    name = srv.cfg.router.names["default"]
    assert {f"{name}:latest", "auto:latest"} <= {m.model for m in oc.list().models}
    opts = {"temperature": 0, "num_predict": 16, "seed": 3, "repeat_penalty": 1.0, "top_k": 1, "min_p": 0.0}
    whole = oc.chat(name, messages=[{"role": "user", "content": "Name three colours."}], options=opts)
    parts = list(oc.chat(name, messages=[{"role": "user", "content": "Name three colours."}], options=opts,
                         stream=True))
    assert whole.message.content and "".join(p.message.content for p in parts) == whole.message.content
    assert whole.eval_count == parts[-1].eval_count and whole.prompt_eval_count > 0 and whole.total_duration > 0
    local = rt.generate("Name three colours.", max_tokens=16,
                        sampling=SamplingParams(temperature=0, seed=3, repeat_penalty=1.0, top_k=1, min_p=0.0))
    assert whole.message.content == local.text   # the same weights, the same greedy answer
    gen = oc.generate(name, "The capital of France is", raw=True, options={"temperature": 0, "num_predict": 4})
    assert "Paris" in gen.response


def test_embeddings_and_a_json_schema_format(routed, rt):
    srv, oc, _ = routed
    name = srv.cfg.router.names["default"]
    got = np.asarray(oc.embed(name, ["a cat", "a dog"]).embeddings)
    want = rt.embed(["a cat", "a dog"], model=srv.cfg.router.routes["default"])
    assert got.shape == want.shape and np.allclose(got, want, atol=1e-4)
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 20},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["colour", "count"]}
    for seed in (1, 2):
        r = oc.chat(name, messages=[{"role": "user", "content": "Give a colour and a count as JSON."}],
                    format=schema, options={"temperature": 0.7, "seed": seed, "num_predict": 64})
        jsonschema.validate(json.loads(r.message.content), schema)


def test_requests_are_routed_by_task_and_no_third_copy_loads(routed, rt):
    srv, oc, loads = routed
    names = srv.cfg.router.names
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=60, trust_env=False) as c:
        r = c.post("/api/chat", json={"model": "auto", "messages": [{"role": "user", "content": CODE_ASK}],
                                      "stream": False, "options": {"num_predict": 4, "temperature": 0}})
        assert r.status_code == 200, r.text
        route = r.json()["a3b"]["route"]
        assert (route["route"], route["model"], route["method"]) == ("code", names["code"], "rules")
        assert r.headers["x-a3b-route"].startswith("code;")
        r = c.post("/v1/chat/completions", json={"model": "auto", "max_tokens": 4, "temperature": 0,
                                                 "messages": [{"role": "user", "content": PROSE_ASK}]})
        assert r.status_code == 200, r.text
        route = r.json()["a3b"]["route"]
        assert route["method"] == "tokens" and route["route"] == "default" and route["model"] == names["default"]
        assert r.json()["choices"][0]["message"]["content"]
    assert rt.store.weight_loads - loads == 2   # each file's weights once, whatever contexts share them


def test_bad_requests_get_ollamas_errors(routed):
    srv, oc, _ = routed
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat("no-such-model", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        oc.generate(srv.cfg.router.names["default"], "Hi", options={"num_ctx": 10**6})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        oc.generate(srv.cfg.router.names["default"], "Hi", options={"mirostat": 2})
    assert e.value.status_code == 400 and "mirostat" in e.value.error
