"""`a3b serve` and the remote engine with real parts only (slow tier).

* the remote: llama-cpp-python's own OpenAI-compatible server (`python -m llama_cpp.server`, the
  `server` extra) on the embedded model, started once for this module;
* `a3b serve` on the embedded model, driven by the official `openai` client and by an /infill
  request shaped like llama.vim's;
* the remote engine against both, the node graph A3BLoader + A3BGenerate over a remote URL, and
  the language server over a remote model.

Servers bind to 127.0.0.1 on free ports, start within a deadline and are stopped also on failure.
"""
from __future__ import annotations

import subprocess
import time

import httpx
import numpy as np
import pytest
import pytest_asyncio

from comfyui_a3b.bench.bench_serve import stop, wait_ready
from comfyui_a3b.bench.common import free_port, llama_cpp_server

pytestmark = pytest.mark.slow

KEY = "remote-key"
TOKEN = "serve-token"


@pytest.fixture(scope="module")
def llama_server(default_path, tmp_path_factory):
    """llama_cpp.server on the embedded model, with an API key; its /v1 URL."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("llama_server") / "server.log", "wb")
    proc = subprocess.Popen([*llama_cpp_server(), "--model", str(default_path),
                             "--model_alias", "smol", "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
                             "--embedding", "true", "--logits_all", "true", "--api_key", KEY, "--verbose", "false"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}/v1/models", proc, 90, {"Authorization": f"Bearer {KEY}"})
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop(proc)
        log.close()


@pytest.fixture(scope="module")
def served(rt):
    """`a3b serve` in this process on the embedded model, with a token."""
    from comfyui_a3b.serve import Server

    # a context of its own (no other module's requests in its cache), so its first answers are a fresh model's
    srv = Server(rt.spec(None, n_parallel=4, n_ctx=2000), "127.0.0.1", 0, token=TOKEN).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture()
def remote_env(monkeypatch, remote_models_unloaded):
    monkeypatch.setenv("A3B_REMOTE_API_KEY", KEY)


# -- a3b serve, driven by the openai client ----------------------------------------------------------------
def test_openai_client_against_a3b_serve(served, rt):
    import openai

    client = openai.OpenAI(base_url=served.url, api_key=TOKEN)
    (model,) = [m.id for m in client.models.list()]
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24, stream=True,
        temperature=0, seed=1, extra_body={"repeat_penalty": 1.0, "top_k": 1, "min_p": 0.0}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and chunks[-1].choices[0].finish_reason in ("stop", "length")
    local = _fresh_answer(rt, "Name three colours.", max_tokens=24, sampling=_greedy(seed=1))
    assert text == local.text   # the same weights, the same greedy answer
    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                     logprobs=3)
    assert "Paris" in comp.choices[0].text and len(comp.choices[0].logprobs.top_logprobs[0]) == 3
    emb = client.embeddings.create(model=model, input=["a cat", "a kitten", "a stock market crash"])
    v = np.array([d.embedding for d in emb.data])
    assert v.shape == (3, 576) and v[0] @ v[1] > v[0] @ v[2]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url, api_key="wrong").models.list()


def test_abandoned_stream_then_a_fast_request(served, rt):
    import openai

    client = openai.OpenAI(base_url=served.url, api_key=TOKEN)
    model = rt.loaded(served.cfg.spec)
    stream = client.completions.create(model=served.cfg.model_id, prompt="Once upon a time",
                                       max_tokens=400, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    t0 = time.monotonic()
    quick = client.completions.create(model=served.cfg.model_id, prompt="1, 2, 3,", max_tokens=4, temperature=0)
    assert quick.choices[0].text and time.monotonic() - t0 < 10
    while model.busy() and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert not model.busy(), "the abandoned generation went on"


def test_infill_like_llama_vim(served):
    body = {"input_prefix": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
            "input_suffix": "\n\nprint(fibonacci(10))\n",
            "input_extra": [{"text": "def square(x):\n    return x * x\n", "time": 0, "filename": "util.py"}],
            "prompt": "    if n < 2:", "n_predict": 24, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.99,
            "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 3000, "response_fields": ["content", "timings"]}
    r = httpx.post(served.url[:-3] + "/infill", json=body, headers={"Authorization": f"Bearer {TOKEN}"},
                   timeout=60, trust_env=False)
    out = r.json()
    assert r.status_code == 200, out
    assert out["content"].strip() and out["timings"]["predicted_n"] >= 1 and out["tokens_evaluated"] > 20


def test_prompts_sent_again_are_read_from_the_cache(served):
    """Prompts that share only their first words, one after another, then each again: the second time
    each is read from its slot's cache (OpenAI's `cached_tokens`), as from a server that has served them."""
    def usage(i: int) -> dict:
        body = {"prompt": f"Request {i}: write a long report about the lighthouses of the northern coast.",
                "max_tokens": 8, "temperature": 0}
        r = httpx.post(served.url + "/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"},
                       timeout=60, trust_env=False)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    first = [usage(i) for i in range(3)]
    again = [usage(i) for i in range(3)]
    for a, b in zip(first, again):
        assert b["prompt_tokens_details"]["cached_tokens"] == b["prompt_tokens"] - 1 > 10, (a, b)


# -- the remote engine ---------------------------------------------------------------------------------
def test_remote_engine_round_trip_through_a3b_serve(served, rt, monkeypatch):
    monkeypatch.setenv("A3B_REMOTE_API_KEY", TOKEN)
    try:
        res = rt.generate("Name three colours.", model=served.url, max_tokens=24, sampling=_greedy(seed=1))
        local = _fresh_answer(rt, "Name three colours.", max_tokens=24, sampling=_greedy(seed=1))
        assert res.text == local.text
        m = rt.load(rt.spec(served.url))
        assert m.features["infill"] and m.features["tokenize"] == "/tokenize"
        remote_vecs = rt.embed(["a cat", "a kitten"], model=served.url)
        assert np.allclose(remote_vecs, rt.embed(["a cat", "a kitten"]), atol=1e-4)
    finally:
        rt.unload(rt.spec(served.url))


def test_remote_engine_against_llama_cpp_server(llama_server, rt, remote_env):
    from comfyui_a3b.runtime import ConfidenceConfig

    m = rt.load(rt.spec(llama_server))
    assert m.name == "smol" and m.features["server"] == "llama_cpp.server"
    res = rt.generate("Name three colours.", model=llama_server, max_tokens=24, sampling=_greedy())
    assert res.text.strip() and res.n_tokens > 1
    res = rt.generate("The capital of France is", model=llama_server, chat=False, max_tokens=24,
                      sampling=_greedy(), stop=["\n"], confidence=ConfidenceConfig(threshold=1.0, min_run=1))
    assert "Paris" in res.text and "\n" not in res.text
    assert len(res.entropies) >= 1   # from the server's top_logprobs
    # embeddings: the server answers one vector per token for this model; the engine pools them
    vecs = rt.embed(["a cat", "a kitten", "a stock market crash"], model=llama_server)
    assert vecs.shape == (3, 576) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2]
    # a stream cancelled between tokens: the server sees the connection close
    stream = rt.submit("Once upon a time", model=llama_server, chat=False, max_tokens=300)
    n = 0
    for _ in stream:
        n += 1
        if n == 3:
            stream.cancel()
    assert stream.cancelled and n < 30
    res = rt.generate("2 + 2 =", model=llama_server, chat=False, max_tokens=3, sampling=_greedy())
    assert res.text


def test_remote_bad_inputs_on_a_real_server(llama_server, rt, remote_env, monkeypatch):
    from comfyui_a3b.runtime import ModelNotFound, PromptTooLong, RemoteAuthFailed, RemoteProtocolError

    with pytest.raises(ModelNotFound, match="smol"):
        rt.load(rt.spec(llama_server + "#no-such-model"))
    # larger than the context: counted exactly through the server's tokenize endpoint ...
    with pytest.raises(PromptTooLong, match="tokens but the context holds 1024"):
        rt.submit("hello " * 1100, model=rt.spec(llama_server, n_ctx=1024), chat=False)
    # ... and when our budget is larger than the server's context, llama_cpp.server ends the stream
    # at once without a word; that is told from a finished answer
    with pytest.raises(RemoteProtocolError, match="without finishing"):
        rt.generate("hello " * 2100, model=rt.spec(llama_server, n_ctx=8192), chat=False, max_tokens=4)
    monkeypatch.setenv("A3B_REMOTE_API_KEY", "wrong")
    rt.unload()
    with pytest.raises(RemoteAuthFailed, match="HTTP 401"):
        rt.load(rt.spec(llama_server))


def test_node_graph_over_a_remote_url(llama_server, rt, remote_env, monkeypatch):
    """A3BLoader + A3BGenerate (+ A3BEmbed) through the node contract, the model on a server."""
    from comfyui_a3b.nodes import core, defs
    from comfyui_a3b.nodes.v1 import NODE_CLASS_MAPPINGS

    ref = llama_server + "#smol"
    monkeypatch.setenv("A3B_REMOTE_MODELS", ref)
    assert ref in core.model_choices()
    handle = NODE_CLASS_MAPPINGS["A3BLoader"]().run(unique_id="1", **{**defs.LOADER.defaults(),
                                                                       "model": ref})["result"][0]
    out = NODE_CLASS_MAPPINGS["A3BGenerate"]().run(
        unique_id="2", model=handle, prompt="Write one sentence about the moon.", system="", max_new_tokens=24,
        temperature=0.0, top_p=0.95, top_k=40, min_p=0.05, repeat_penalty=1.1, seed=7, stop="",
        confidence_aware=True)
    assert out["result"][0].strip()
    emb = NODE_CLASS_MAPPINGS["A3BEmbed"]().run(unique_id="3", model=handle, text="one\ntwo", pooling="mean",
                                                normalize=True)
    assert emb["result"][0] is not None


# -- the language server over a remote model ----------------------------------------------------------------
@pytest_asyncio.fixture(loop_scope="function")
async def lsp_client(llama_server):
    from lsp_helpers import remote_model_client

    async with remote_model_client(llama_server, KEY) as c:
        yield c


async def test_language_server_over_a_remote_model(lsp_client):
    from lsp_helpers import inline_on_sample, status

    items = await inline_on_sample(lsp_client, "file:///w/remote_demo.py")
    assert len(items) == 1 and items[0].strip(), items
    assert (await status(lsp_client))["model"] == "smol"


def _fresh_answer(rt, prompt: str, **kw):
    """The request in this process on a model loaded for it alone. Greedy answers are compared with
    a fresh cache on both sides: a prompt prefix computed earlier in another batch (beside another
    request, or as drafts) can differ in its last bits and tip a near tie to another token."""
    spec = rt.spec(None, n_parallel=1, n_ctx=1000)
    try:
        return rt.generate(prompt, model=spec, **kw)
    finally:
        rt.unload(spec)


def _greedy(seed: int | None = None):
    from comfyui_a3b.runtime import preset

    return preset("greedy", seed=seed)
