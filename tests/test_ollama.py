"""Ollama's API on `a3b serve` over the fake engine (fast tier): the real `ollama` client and the
request shapes of comfyui-ollama, Open WebUI and Continue; options mapped to the runtime's with their
bounds, refusals naming the field, Ollama's error shapes, keep_alive, thinking, tools and images.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from urllib.parse import quote

import httpx
import ollama
import pytest

from serve_helpers import TOKEN

ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture()
def oc(server):
    return ollama.Client(host=f"http://127.0.0.1:{server.port}", headers={"Authorization": f"Bearer {TOKEN}"})


@contextmanager
def serving(ref: str, **kw):
    from comfyui_a3b.runtime import get_runtime
    from comfyui_a3b.serve import Server

    rt = get_runtime()
    name = ref.split("://")[1].split("?")[0]
    srv = Server(rt.spec(ref, n_parallel=2, n_ctx=1024), "127.0.0.1", 0, name=name, **kw).start()
    try:
        yield ollama.Client(host=f"http://127.0.0.1:{srv.port}"), srv
    finally:
        srv.stop()
        rt.unload()


def lines(r: httpx.Response) -> list[dict]:
    return [json.loads(x) for x in r.text.splitlines() if x.strip()]


# -- the ollama client ---------------------------------------------------------------------------------
def test_list_show_version_and_ps_with_the_ollama_client(oc):
    names = [m.model for m in oc.list().models]
    assert "fakemodel:latest" in names
    shown = oc.show("fakemodel")
    assert "completion" in shown.capabilities and shown.modelinfo
    assert any(k.endswith(".context_length") and v == 512 for k, v in shown.modelinfo.items())
    oc.generate("fakemodel", "Hello", options={"num_predict": 2})
    assert [m.model for m in oc.ps().models] == ["fakemodel:latest"]


def test_chat_streamed_and_whole_agree(oc):
    whole = oc.chat("fakemodel:latest", messages=ASK, options={"temperature": 0, "num_predict": 12})
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 12
    assert whole.prompt_eval_count > 0 and whole.total_duration > 0 and whole.eval_duration >= 0
    parts = list(oc.chat("fakemodel", messages=ASK, stream=True, options={"temperature": 0, "num_predict": 12}))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content != ""


def test_generate_with_the_options_comfyui_ollama_sends(oc):
    # OllamaGenerateAdvance: float widgets for integers, tfs_z at its neutral 1, keep_alive in minutes
    opts = {"seed": 1234, "top_k": 40.0, "top_p": 0.9, "temperature": 0.8, "num_predict": 9.0, "tfs_z": 1.0}
    a = oc.generate("fakemodel", "What is Art?", system="You are an art expert.", options=opts, keep_alive="5m")
    b = oc.generate("fakemodel", "What is Art?", system="You are an art expert.", options=opts, keep_alive="5m")
    assert a.response == b.response and a.eval_count == 9


def test_stop_strings_and_seed_are_honoured(oc):
    r = oc.generate("fakemodel", "Hi", options={"num_predict": 40, "stop": ["fox"], "temperature": 0})
    assert "fox" not in r.response and r.done_reason == "stop"


def test_embed_and_the_older_embeddings(oc, monkeypatch):
    from comfyui_a3b.runtime import Runtime

    e = oc.embed("fakemodel", ["one text", "another text"], truncate=False)
    assert len(e.embeddings) == 2 and abs(sum(x * x for x in e.embeddings[0]) - 1) < 1e-3
    # the tokens embedded: a token per byte in the fake vocabulary, and its BOS before each text
    assert e.prompt_eval_count == len("one text") + len("another text") + 2
    old = oc.embeddings("fakemodel", "one text")
    assert len(old.embedding) == len(e.embeddings[0])
    # the count is the engine's, made while embedding: without truncation nothing is tokenized again
    monkeypatch.setattr(Runtime, "tokenize", lambda *a, **k: pytest.fail("tokenized again for the count"))
    assert oc.embed("fakemodel", ["one text"], truncate=False).prompt_eval_count == 9


def test_a_model_not_served_is_ollamas_404(oc, client):
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat("llama3.2", messages=ASK)
    assert e.value.status_code == 404 and "llama3.2" in e.value.error
    r = client.post("/api/generate", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json() == {"error": "model 'nope' not found"}


# -- refusals naming the field ---------------------------------------------------------------------------
@pytest.mark.parametrize("options, word", [
    ({"mirostat": 2}, "mirostat"), ({"typical_p": 0.5}, "typical_p"), ({"presence_penalty": 0.3}, "presence_penalty"),
    ({"frobnicate": 1}, "frobnicate"), ({"temperature": 9}, "temperature"), ({"top_k": -3}, "top_k"),
    ({"num_ctx": 100000}, "num_ctx"), ({"num_predict": -2}, "num_predict"),
    ({"temperature": float("nan")}, "temperature"),
])
def test_options_not_honoured_or_out_of_bounds_are_400_naming_them(client, options, word):
    r = client.post("/api/chat", content=json.dumps({"model": "fakemodel", "messages": ASK, "options": options}))
    assert r.status_code == 400, r.text
    assert word in r.json()["error"]


def test_neutral_and_placement_options_are_taken(client):
    opts = {"mirostat": 0, "tfs_z": 1, "typical_p": 1, "num_thread": 4, "num_gpu": 99, "use_mmap": True,
            "num_ctx": 256, "num_predict": 3}
    r = client.post("/api/chat", json={"model": "fakemodel", "messages": ASK, "options": opts, "stream": False})
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] == 3


def test_a_prompt_longer_than_num_ctx_is_refused(client):
    r = client.post("/api/generate", json={"model": "fakemodel", "prompt": "word " * 200, "options": {"num_ctx": 32}})
    assert r.status_code == 400 and "num_ctx" in r.json()["error"]


@pytest.mark.parametrize("body", [b'{"model": "fakemodel", "prompt": ', b'{"model": "fakemodel"}\n{"prompt": "x"}\n',
                                  b"[1, 2]", b"\xff\xfe"])
def test_malformed_bodies_are_400_in_ollamas_shape(client, body):
    r = client.post("/api/generate", content=body)
    assert r.status_code == 400 and set(r.json()) == {"error"}


@pytest.mark.parametrize("field, value", [("format", "yaml"), ("keep_alive", "5 parsecs"), ("think", "maybe"),
                                          ("template", "{{ .Prompt }}"), ("context", [1, 2, 3]),
                                          ("images", ["not base64!"])])
def test_generate_fields_that_do_not_fit_are_named(client, field, value):
    r = client.post("/api/generate", json={"model": "fakemodel", "prompt": "Hi", field: value})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"] or field == "images"


def test_the_token_and_origin_rules_hold(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", trust_env=False) as c:
        assert c.get("/api/tags").status_code == 401
        assert c.get("/api/tags", headers={"Authorization": f"Bearer {TOKEN}",
                                           "Origin": "http://evil.test"}).status_code == 403


def test_root_and_version_answer_as_ollama_does(client):
    assert client.get("/").text == "Ollama is running"
    assert client.get("/api/version").json()["version"]
    assert client.post("/api/pull", json={"model": "x"}).status_code == 501


# -- keep_alive --------------------------------------------------------------------------------------------
def test_keep_alive_zero_unloads_once_idle(fake_engine):
    from comfyui_a3b.runtime import get_runtime

    with serving("fake://keep?delay_ms=1") as (c, srv):
        rt = get_runtime()
        c.generate("keep", "Hi", options={"num_predict": 2}, keep_alive=-1)
        assert rt.loaded(srv.cfg.spec) is not None
        assert c.ps().models[0].expires_at.year > 2030
        c.generate("keep", "Hi", options={"num_predict": 2}, keep_alive=0)
        deadline = time.monotonic() + 5
        while rt.loaded(srv.cfg.spec) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rt.loaded(srv.cfg.spec) is None
        assert c.generate("keep", "Hi", options={"num_predict": 2}).eval_count == 2   # loads it again
        r = c.generate("keep", "", keep_alive="1m")   # Ollama's way to load a model
        assert r.done_reason == "load"


# -- thinking, tools, images, format -------------------------------------------------------------------------
def test_think_puts_the_reasoning_in_message_thinking(fake_engine):
    with serving("fake://think?template=qwen3&think=I+add+2+and+2.&text=It+is+4.&eos_after=41") as (c, _):
        zero = {"temperature": 0}
        r = c.chat("think", messages=ASK, think=True, options=zero)
        assert r.message.thinking == "I add 2 and 2." and r.message.content == "It is 4."
        parts = list(c.chat("think", messages=ASK, think=True, stream=True, options=zero))
        assert "".join(p.message.thinking or "" for p in parts) == "I add 2 and 2."
        g = c.generate("think", "What is 2 + 2?", think=True, options=zero)
        assert g.thinking == "I add 2 and 2." and g.response == "It is 4."


def test_tool_calls_come_back_with_arguments_as_objects(fake_engine):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    ref = f"fake://tool?template=qwen3&text={quote(call)}&eos_after={len(call.encode())}"
    with serving(ref) as (c, _):
        r = c.chat("tool", messages=ASK, tools=tools, options={"temperature": 0})
        assert r.message.tool_calls[0].function.name == "get_weather"
        assert r.message.tool_calls[0].function.arguments == {"city": "Paris"}
        parts = list(c.chat("tool", messages=ASK, tools=tools, stream=True, options={"temperature": 0}))
        calls = [tc for p in parts for tc in p.message.tool_calls or []]
        assert len(calls) == 1 and calls[0].function.arguments == {"city": "Paris"}
        # the answer goes back as a tool message, named as Ollama names it
        back = ASK + [{"role": "assistant", "content": "", "tool_calls": [{"function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "18 degrees", "tool_name": "get_weather"}]
        assert c.chat("tool", messages=back, tools=tools).done


def test_images_reach_a_vision_model(fake_engine):
    import base64

    from comfyui_a3b.runtime.images import RGBImage, png_bytes

    png = base64.b64encode(png_bytes(RGBImage(8, 6, bytes(range(144)), ""))).decode()
    with serving("fake://seeing?vision=1") as (c, _):
        seen = c.chat("seeing", messages=[{"role": "user", "content": "What is this?", "images": [png]}],
                      options={"num_predict": 8, "temperature": 0})
        blind = c.chat("seeing", messages=[{"role": "user", "content": "What is this?"}],
                       options={"num_predict": 8, "temperature": 0})
        assert seen.message.content != blind.message.content


def test_format_goes_through_the_grammar_path(client):
    r = client.post("/api/chat", json={"model": "fakemodel", "messages": ASK, "stream": False, "format": "json",
                                       "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 400 and "format" in r.json()["error"]


# -- Open WebUI and Continue ---------------------------------------------------------------------------------
def test_the_shapes_open_webui_and_continue_send(client):
    # Open WebUI: GET /api/version and /api/tags, then a streamed /api/chat with its options and keep_alive
    assert client.get("/api/tags").status_code == 200
    r = client.post("/api/chat", json={"model": "fakemodel:latest", "messages": ASK, "stream": True,
                                       "options": {"temperature": 0.7, "top_p": 0.9, "num_predict": 5},
                                       "keep_alive": "5m"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    assert lines(r)[-1]["done"] is True
    # Continue: /api/show for the context length, then /api/generate raw with its FIM prompt, keep_alive seconds
    show = client.post("/api/show", json={"name": "fakemodel"}).json()
    assert show["model_info"]
    r = client.post("/api/generate", json={"model": "fakemodel", "prompt": "def add(a, b):", "suffix": "\n",
                                           "raw": False, "keep_alive": 1800, "stream": False,
                                           "options": {"num_predict": 4, "temperature": 0.01, "num_ctx": 512,
                                                       "stop": ["\n\n"]}})
    assert r.status_code == 200, r.text
    r = client.post("/api/generate", json={"model": "fakemodel", "prompt": "<fim_prefix>x", "raw": True,
                                           "stream": False, "options": {"num_predict": 4}})
    assert r.status_code == 200 and r.json()["eval_count"] == 4
