"""`a3b serve` and the remote engine over the fake engine (fast tier).

A real uvicorn server on a free loopback port serves the runtime's fake model; requests come from a
real HTTP client, and the remote engine talks to the same server. The real model, the openai
client and llama_cpp.server are in test_serve_real.py (slow tier).
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from serve_helpers import MODEL, TEXT, TOKEN


@pytest.fixture()
def remote(server, monkeypatch):
    """The server's URL as a model reference, with the API key in the environment."""
    from comfyui_a3b.runtime import get_runtime

    monkeypatch.setenv("A3B_REMOTE_API_KEY", TOKEN)
    url = f"http://127.0.0.1:{server.port}/v1"
    yield url
    rt = get_runtime()
    for e in rt.store.loaded():
        if e.spec.path.startswith("http"):
            rt.unload(e.spec)


def sse(resp) -> list[dict]:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


# -- security ------------------------------------------------------------------------------------------
def test_token_host_and_origin(server, client):
    base = f"http://127.0.0.1:{server.port}"
    assert client.get("/health").json() == {"status": "ok"}
    r = httpx.get(base + "/v1/models", trust_env=False)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"}, trust_env=False)
    assert r.status_code == 401
    r = client.get("/v1/models", headers={"Origin": "http://evil.test"})
    assert r.status_code == 403 and "Origin" in r.json()["error"]["message"]
    r = client.get("/v1/models", headers={"Origin": "http://allowed.test"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://allowed.test"
    pre = httpx.options(base + "/v1/chat/completions", trust_env=False, headers={
        "Origin": "http://allowed.test", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200
    r = client.get("/health", headers={"Host": "attacker.test"})   # DNS rebinding
    assert r.status_code == 403
    assert client.get("/v1/models").json()["data"][0]["id"] == "fakemodel"


def test_non_loopback_needs_token(fake_engine):
    from comfyui_a3b.runtime import InvalidRequest, get_runtime
    from comfyui_a3b.serve import Server

    with pytest.raises(InvalidRequest, match="token"):
        Server(get_runtime().spec(MODEL), "0.0.0.0", 0)

# -- the OpenAI endpoints ------------------------------------------------------------------------------
def test_chat_and_completion(client):
    r = client.post("/v1/chat/completions", json={"model": "fakemodel", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 12, "temperature": 0, "seed": 3})
    body = r.json()
    assert r.status_code == 200, body
    assert body["choices"][0]["message"]["content"] == TEXT[:12]
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 12
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True,
                                                         "stop": ["fox"], "logprobs": 2, "temperature": 0}) as r:
        chunks = sse(r)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "The quick brown "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    lp = chunks[0]["choices"][0]["logprobs"]
    assert lp["tokens"] == ["T"] and len(lp["top_logprobs"][0]) == 2
    # token ids as the prompt, and the chat stream's shape
    r = client.post("/v1/completions", json={"prompt": [8 + ord("a"), 8 + ord("b")], "max_tokens": 3, "temperature": 0})
    assert r.json()["choices"][0]["text"] == "The"
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}) as r:
        chunks = sse(r)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "The q"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_chat_template_kwargs_reach_the_template(client, fake_engine):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2,
                                                  "chat_template_kwargs": {"note": "Z9q"}})
    assert r.status_code == 200, r.text
    from fakeengine import OFFSET

    want = bytes(OFFSET + b for b in b"assistant\nZ9q")
    assert any(want in bytes(t for t in kv if 0 <= t < 256) for b in fake_engine.backends for kv in b.kv.values())
    r = client.post("/v1/chat/completions", json={"messages": msgs, "chat_template_kwargs": ["note"]})
    assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"]


def test_embeddings(client, monkeypatch):
    from comfyui_a3b.runtime import Runtime

    # the usage is the count the engine made while embedding: the texts are not tokenized again
    monkeypatch.setattr(Runtime, "tokenize", lambda *a, **k: pytest.fail("tokenized again for the usage"))
    r = client.post("/v1/embeddings", json={"input": ["alpha", "beta"], "model": "fakemodel"}).json()
    vecs = np.array([d["embedding"] for d in r["data"]])
    assert vecs.shape == (2, 32) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    # the tokens embedded: a token per byte in the fake vocabulary, and its BOS before each text
    assert r["usage"] == {"prompt_tokens": 11, "total_tokens": 11}
    b = client.post("/v1/embeddings", json={"input": "alpha", "encoding_format": "base64"}).json()
    import base64

    assert np.allclose(np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype=np.float32), vecs[0], atol=1e-6)


def test_infill_like_llama_vim(client, fake_engine):
    """The request body llama.vim sends (its fields, extra chunks and time limits)."""
    body = {"id_slot": 0, "input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
            "input_extra": [{"text": "import math\n", "time": 0, "filename": "util.py"}], "prompt": "    return",
            "n_predict": 6, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1000, "response_fields": ["content", "timings"]}
    r = client.post("/infill", json=body)
    out = r.json()
    assert r.status_code == 200, out
    assert out["content"] and out["stop"] is True and out["timings"]["predicted_n"] == 6
    from fakeengine import FIM_MID, FIM_PRE, FIM_SUF

    seen = [b for b in fake_engine.backends if any(FIM_PRE in kv for kv in b.kv.values())]
    assert seen, "the prompt did not reach the model as a fill-in-the-middle prompt"
    kv = next(kv for b in seen for kv in b.kv.values() if FIM_PRE in kv)
    assert kv.index(FIM_PRE) < kv.index(FIM_SUF) < kv.index(FIM_MID)


@pytest.mark.parametrize("body,status,code", [
    ("not json", 400, "invalid_request"),
    ({"messages": "hi"}, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": float("nan")}, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model_not_found"),
    ({"messages": [{"role": "user", "content": "x " * 2000}]}, 400, "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "invalid_request"),
    ([1, 2, 3], 400, "invalid_request"),
    pytest.param("[" * 100_000 + "]" * 100_000, 400, "invalid_request", id="deeply-nested"),
])
def test_bad_requests(client, body, status, code):
    kw = {"content": body} if isinstance(body, str) else {"content": json.dumps(body, allow_nan=True)}
    r = client.post("/v1/chat/completions", headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text

def test_disconnect_cancels_between_tokens(server, client):
    from comfyui_a3b.runtime import get_runtime

    model = get_runtime().load(server.cfg.spec)
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 500, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    t0 = time.monotonic()
    while model.busy() and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert not model.busy(), "the abandoned stream kept generating"
    assert model.stats["finished_cancelled"] >= 1
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 0})
    assert r.json()["choices"][0]["text"] == "The"

# -- the remote engine against a3b serve -----------------------------------------------------------------
def test_remote_round_trip(remote, fake_engine):
    from comfyui_a3b.runtime import ContextChunk, InfillPrompt, SamplingParams, get_runtime

    rt = get_runtime()
    m = rt.load(rt.spec(remote))
    assert m.info.engine.startswith("remote") and m.features["infill"] and m.features["tokenize"] == "/tokenize"
    res = rt.generate("hello", model=remote, max_tokens=10, sampling=SamplingParams(temperature=0))
    assert res.text == TEXT[:10] and res.finish_reason == "length"   # chat: via /v1/chat/completions
    res = rt.generate("x", model=remote, chat=False, max_tokens=30, stop=["brown"],
                      sampling=SamplingParams(temperature=0))
    assert res.text == "The quick "
    stream = rt.submit("x", model=remote, chat=False, max_tokens=400)
    got = []
    for ev in stream:
        got.append(ev.text)
        if len(got) == 3:
            stream.cancel()
    assert 3 <= len(got) < 50 and stream.cancelled
    vecs = rt.embed(["alpha", "beta"], model=remote)
    assert vecs.shape == (2, 32)
    # a fill-in-the-middle prompt reaches the server's /infill as its parts, and its model as FIM tokens
    assert m.supports_fim
    res = rt.submit(InfillPrompt("def remote_f():\n", "\n", chunks=[ContextChunk("u.py", "import os")]),
                    model=remote, max_tokens=4, sampling=SamplingParams(temperature=0)).result(20)
    assert res.text == TEXT[:4] and res.tokens is None and res.n_tokens == 4
    from fakeengine import FIM_MID, FIM_PRE, FIM_SUF, OFFSET

    want = [OFFSET + b for b in b"import os\ndef remote_f():\n"]
    kvs = [kv for b in fake_engine.backends for kv in b.kv.values() if FIM_PRE in kv]
    assert any(kv[kv.index(FIM_PRE) + 1:kv.index(FIM_SUF)] == want and FIM_MID in kv for kv in kvs)


def test_remote_confidence_from_top_logprobs(remote):
    from comfyui_a3b.runtime import ConfidenceConfig, get_runtime

    rt = get_runtime()
    res = rt.generate("x", model=remote, chat=False, max_tokens=8,
                      confidence=ConfidenceConfig(threshold=0.5, min_run=2))
    assert len(res.entropies) == 8 and all(e > 0 for e in res.entropies)


def test_remote_bad_inputs(remote, monkeypatch, server):
    from comfyui_a3b.runtime import (InvalidRequest, PathNotAllowed, PromptTooLong, RemoteAuthFailed,
                                     RemoteUnreachable, get_runtime)

    rt = get_runtime()
    with pytest.raises(InvalidRequest, match="credentials"):
        rt.spec(f"http://user:{TOKEN}@127.0.0.1:{server.port}/v1")
    with pytest.raises(PathNotAllowed, match="A3B_REMOTE_MODELS"):
        rt.spec(remote, restrict=True)
    monkeypatch.setenv("A3B_REMOTE_MODELS", remote)
    assert rt.spec(remote, restrict=True).path == remote
    with pytest.raises(PromptTooLong):
        rt.generate("word " * 600, model=remote, chat=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with pytest.raises(RemoteUnreachable, match="not reachable"):
        rt.load(rt.spec(f"http://127.0.0.1:{dead}/v1"))
    monkeypatch.setenv("A3B_REMOTE_API_KEY", "wrong")
    with pytest.raises(RemoteAuthFailed, match="A3B_REMOTE_API_KEY"):
        rt.load(rt.spec(f"http://127.0.0.1:{server.port}/v1#fakemodel"))


def _one_shot_server(reply: bytes) -> tuple[int, threading.Thread]:
    """A socket server answering every connection with `reply` and closing (a server that is not
    an OpenAI server, or one that breaks off an answer)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.settimeout(10)

    def run():
        try:
            for _ in range(8):
                conn, _ = sock.accept()
                with conn:
                    conn.settimeout(5)
                    data = b""
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(65536)
                    head, _, rest = data.partition(b"\r\n\r\n")
                    n = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                              if h.lower().startswith(b"content-length")), 0)
                    while len(rest) < n:
                        rest += conn.recv(65536)
                    path = head.split(b" ")[1]
                    conn.sendall(reply(path) if callable(reply) else reply)
        except OSError:
            pass
        finally:
            sock.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return sock.getsockname()[1], t


def test_remote_not_openai_and_closed_mid_stream():
    from comfyui_a3b.runtime import RemoteProtocolError, get_runtime

    rt = get_runtime()
    html = b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 13\r\nConnection: close\r\n\r\n<html></html>"
    port, t = _one_shot_server(html)
    with pytest.raises(RemoteProtocolError, match="not an OpenAI-compatible server"):
        rt.load(rt.spec(f"http://127.0.0.1:{port}/v1"))
    t.join(0.1)

    def reply(path: bytes) -> bytes:
        if path.endswith(b"/models"):
            body = b'{"object":"list","data":[{"id":"m"}]}'
            return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                    b"Connection: close\r\n\r\n%s" % (len(body), body))
        if path.endswith(b"/completions"):
            chunk = b'data: {"choices":[{"index":0,"text":"Hel","finish_reason":null}]}\n\n'
            return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + b"%x\r\n%s\r\n" % (len(chunk), chunk))   # then the connection closes mid-stream
        return b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

    port, t = _one_shot_server(reply)
    ref = f"http://127.0.0.1:{port}/v1"
    stream = rt.submit("x", model=ref, chat=False, max_tokens=20)
    with pytest.raises(RemoteProtocolError, match="closed the connection") as e:
        stream.result(20)
    assert e.value.partial.text == "Hel"
    rt.unload(rt.spec(ref))


def test_inside_comfyui_process(fake_engine):
    """A3B_SERVE starts the server in this process; the status (the A3B sidebar's source) shows it."""
    from comfyui_a3b.runtime import get_runtime
    from comfyui_a3b.serve import inprocess

    rt = get_runtime()
    assert inprocess.maybe_start({}) is None
    info = inprocess.maybe_start({"A3B_SERVE": "127.0.0.1:0", "A3B_SERVE_MODEL": "fake://inproc"})
    try:
        assert rt.status()["serve"]["url"] == info["url"]
        r = httpx.get(info["url"] + "/models", trust_env=False)
        assert r.json()["data"][0]["id"] == "inproc"
    finally:
        inprocess.stop()
    assert "serve" not in rt.status()
    with pytest.raises(Exception, match="HOST:PORT"):
        inprocess.maybe_start({"A3B_SERVE": "nonsense"})
    assert "error" in rt.status()["serve"]
    rt.status_providers.pop("serve", None)


def test_remote_unload_mid_generation_ends_the_stream(remote):
    """Unloading a remote model does not wait for its server: the running request ends with
    ModelUnloaded and the text so far."""
    from comfyui_a3b.runtime import ModelUnloaded, get_runtime

    rt = get_runtime()
    spec = rt.spec(remote)
    stream = rt.submit("x", model=spec, chat=False, max_tokens=500)
    next(iter(stream))
    t0 = time.monotonic()
    rt.unload(spec)
    with pytest.raises(ModelUnloaded) as e:
        stream.result(10)
    assert time.monotonic() - t0 < 5 and e.value.partial.text
