"""The remote engine against llama.cpp's own llama-server (slow tier).

llama-server is the server users scale out to. It is built once from the llama.cpp sources vendored
in the installed llama-cpp-python's source distribution and cached in the cache folder
(bench/llama_server.py, `llama_server_binary`); the build takes several minutes the first time, and the
tests skip, saying why, where cmake or a compiler is missing.

For this module, two servers run on the embedded model: one for generation (4 slots, /metrics,
/slots) and one for embeddings (llama-server serves embeddings only from a process started with
--embeddings). A third one, started by one test, is killed in the middle of a stream. Everything
goes through public surfaces: the runtime's generate / submit / embed with the server's URL as the
model, the language server over the remote model, and `a3b serve` with the remote model behind it.
Servers bind to 127.0.0.1 on free ports, start within a deadline and are stopped also on failure.
"""
from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import pytest_asyncio

from comfyui_a3b.bench.bench_serve import stop, wait_ready
from comfyui_a3b.bench.common import free_port, llama_server_command

pytestmark = pytest.mark.slow

KEY = "llama-server-key"
#: slots of the generation server, and the context of each (llama-server splits -c among them)
SLOTS, SLOT_CTX = 4, 2048


@dataclass
class LlamaServer:
    proc: subprocess.Popen
    root: str          # http://127.0.0.1:PORT

    @property
    def url(self) -> str:
        """The model reference: the server's OpenAI API base."""
        return self.root + "/v1"

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.root + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=10, trust_env=False)

    def post(self, path: str, body: dict) -> dict:
        r = httpx.post(self.root + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       trust_env=False)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def llama_server_exe(request) -> Path:
    """The llama-server binary: cached, or built now (once, several minutes)."""
    from comfyui_a3b.bench.common import BuildToolsMissing, llama_server_binary

    capture = request.config.pluginmanager.getplugin("capturemanager")

    def say(message: str) -> None:   # shown at once, not captured: a build is a long silent wait otherwise
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(f"\n{message}", flush=True)

    try:
        return llama_server_binary(say)
    except BuildToolsMissing as e:
        pytest.skip(f"llama-server cannot be built here: {e}")


@contextlib.contextmanager
def running(exe: Path, model: Path, log_dir: Path, *options: str):
    """llama-server on `model` with `options`, on 127.0.0.1 and a free port, with an API key. One
    thread each: several servers and this process's own model share the cores."""
    port = free_port()
    log_path = log_dir / f"llama-server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*llama_server_command(exe), "--model", str(model), "--alias", "smol",
                                 "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY, "--threads", "1",
                                 "--no-webui", *options], stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_ready(f"http://127.0.0.1:{port}/health", proc, 60)
            except (RuntimeError, TimeoutError) as e:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"llama-server did not start ({e}); its log ends:\n{tail}") from None
            yield LlamaServer(proc, f"http://127.0.0.1:{port}")
        finally:
            stop(proc)


@pytest.fixture(scope="module")
def server(llama_server_exe, default_path, tmp_path_factory):
    """llama-server for generation on the embedded model: SLOTS parallel slots, /metrics on."""
    with running(llama_server_exe, default_path, tmp_path_factory.mktemp("llama_server"),
                 "--ctx-size", str(SLOTS * SLOT_CTX), "--parallel", str(SLOTS), "--metrics") as s:
        yield s


#: token ids the FIM server takes for fill-in-the-middle: the embedded model has no FIM tokens, so
#: the server is told to take three of its unused special tokens (<jupyter_start>, <jupyter_text>,
#: <jupyter_code>): to the client, a model with FIM tokens
FIM_OVERRIDE = ("tokenizer.ggml.fim_pre_token_id=int:11,tokenizer.ggml.fim_suf_token_id=int:12,"
                "tokenizer.ggml.fim_mid_token_id=int:13")


@pytest.fixture(scope="module")
def fim_server(llama_server_exe, default_path, tmp_path_factory):
    """llama-server on the embedded model with FIM tokens: its /infill answers."""
    with running(llama_server_exe, default_path, tmp_path_factory.mktemp("llama_server_fim"),
                 "--ctx-size", "4096", "--parallel", "2", "--override-kv", FIM_OVERRIDE) as s:
        yield s


@pytest.fixture(scope="module")
def embedding_server(llama_server_exe, default_path, tmp_path_factory):
    """llama-server for embeddings on the embedded model (mean pooling)."""
    with running(llama_server_exe, default_path, tmp_path_factory.mktemp("llama_server_embed"),
                 "--embeddings", "--pooling", "mean", "--ctx-size", "2048", "--parallel", "2") as s:
        yield s


@pytest.fixture()
def remote_env(monkeypatch, remote_models_unloaded):
    """The API key for the servers (remote models are unloaded after the test)."""
    monkeypatch.setenv("A3B_REMOTE_API_KEY", KEY)


def _greedy(seed: int | None = None):
    from comfyui_a3b.runtime import preset

    return preset("greedy", seed=seed)


def _metric(s: LlamaServer, name: str) -> float:
    """One value of llama-server's Prometheus /metrics."""
    for line in s.get("/metrics").text.splitlines():
        if line.startswith(f"llamacpp:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"/metrics has no llamacpp:{name}")


def _busy_slots(s: LlamaServer) -> int:
    return sum(1 for slot in s.get("/slots").json() if slot.get("is_processing"))


# -- generation --------------------------------------------------------------------------------------------
def test_chat_and_completion(server, rt, remote_env):
    greedy = {"model": "smol", "temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
    # chat: the messages go to the server as they are, and it applies the model's own template: the
    # answer is the one the server gives its own clients
    msgs = [{"role": "system", "content": "You answer with one word."},
            {"role": "user", "content": "What is the capital of France?"}]
    res = rt.generate(messages=msgs, model=server.url, max_tokens=16, sampling=_greedy())
    direct = server.post("/v1/chat/completions", {**greedy, "messages": msgs, "max_tokens": 16})
    assert "Paris" in res.text and res.text == direct["choices"][0]["message"]["content"]
    res = rt.generate("Name three colours.", model=server.url, max_tokens=24, sampling=_greedy())
    direct = server.post("/v1/chat/completions", {**greedy, "max_tokens": 24,
                                                  "messages": [{"role": "user", "content": "Name three colours."}]})
    assert res.text.strip() and res.text == direct["choices"][0]["message"]["content"]
    # text completion, with a stop string and the length limit
    res = rt.generate("The capital of France is", model=server.url, chat=False, max_tokens=24,
                      sampling=_greedy(), stop=["\n"])
    assert "Paris" in res.text and "\n" not in res.text and res.finish_reason == "stop"
    direct = server.post("/v1/completions", {**greedy, "prompt": "The capital of France is", "max_tokens": 24,
                                             "stop": ["\n"]})
    assert res.text == direct["choices"][0]["text"]
    res = rt.generate("1, 2, 3, 4,", model=server.url, chat=False, max_tokens=5, sampling=_greedy())
    assert res.finish_reason == "length" and res.n_tokens == 5 and res.text.lstrip().startswith("5")


def test_streaming(server, rt, remote_env):
    times: list[float] = []
    stream = rt.submit("Once upon a time", model=server.url, chat=False, max_tokens=48, sampling=_greedy(),
                       on_token=lambda ev: times.append(time.monotonic()))
    pieces = [ev.text for ev in stream]
    res = stream.result(timeout=60)
    assert "".join(pieces) == res.text and len(pieces) >= 24
    # token by token, not the whole answer at the end
    assert times[-1] - times[0] > 0.1 and res.time_to_first_token < res.total_time
    assert res.finish_reason == "length" and res.n_tokens == 48


def test_prompt_tokens_are_counted_by_the_server(server, rt, remote_env):
    prompt = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs."
    res = rt.generate(prompt, model=server.url, chat=False, max_tokens=2, sampling=_greedy())
    n_server = len(server.post("/tokenize", {"content": prompt})["tokens"])
    assert res.n_prompt_tokens == n_server
    # a prompt larger than a slot's context (the budget asked for is larger): refused with the
    # exact count, by the engine or the server, and nothing generated
    long = "hello " * 2100
    n_long = len(server.post("/tokenize", {"content": long})["tokens"])
    assert n_long > SLOT_CTX
    from comfyui_a3b.runtime import PromptTooLong

    predicted = _metric(server, "tokens_predicted_total")
    with pytest.raises(PromptTooLong) as e:
        rt.generate(long, model=rt.spec(server.url, n_ctx=8192), chat=False, max_tokens=4)
    assert str(n_long) in str(e.value) and str(SLOT_CTX) in str(e.value), e.value
    assert _metric(server, "tokens_predicted_total") == predicted


def test_props_give_the_slot_context_and_whether_the_model_fills_in(server, fim_server, rt, remote_env):
    """/props: the context of one slot (the budget of every request), and /infill where the model
    has FIM tokens only (llama-server has the endpoint for every model, answering 501 without)."""
    plain, fim = rt.load(rt.spec(server.url, n_ctx=8192)), rt.load(rt.spec(fim_server.url, n_ctx=8192))
    assert plain.n_ctx_seq == SLOT_CTX and fim.n_ctx_seq == 2048
    assert plain.features["server"] == fim.features["server"] == "llama-server"
    assert fim.supports_fim and not plain.supports_fim
    assert plain.features["tokenize"] == "/tokenize" and plain.tokenize("Paris") == \
        server.post("/tokenize", {"content": "Paris"})["tokens"]


def test_wrong_api_key(server, rt, remote_env, monkeypatch):
    from comfyui_a3b.runtime import RemoteAuthFailed

    monkeypatch.setenv("A3B_REMOTE_API_KEY", "wrong")
    with pytest.raises(RemoteAuthFailed, match="401"):
        rt.generate("Hello", model=server.url, max_tokens=2)


# -- cancellation and a dying server -----------------------------------------------------------------------
def test_cancelled_stream_frees_the_slot(server, rt, remote_env):
    """A stream cancelled between tokens: the server stops generating it (its slot is free again, the
    tokens it predicts stop growing) and answers the next request at once."""
    stream = rt.submit("Once upon a time", model=server.url, chat=False, max_tokens=1500,
                       sampling=_greedy())
    events = iter(stream)
    for _ in range(3):
        next(events)
    stream.cancel()
    assert len(list(events)) < 30 and stream.cancelled
    t0 = time.monotonic()
    while _busy_slots(server) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert _busy_slots(server) == 0, "the server went on generating the cancelled stream"
    predicted = _metric(server, "tokens_predicted_total")
    time.sleep(0.5)
    assert _metric(server, "tokens_predicted_total") == predicted
    t0 = time.monotonic()
    res = rt.generate("2 + 2 =", model=server.url, chat=False, max_tokens=3, sampling=_greedy())
    assert res.text and time.monotonic() - t0 < 10


def test_server_killed_mid_stream(llama_server_exe, default_path, tmp_path, rt, remote_env):
    """The server dies while it streams: the stream ends with an error that says so, within a bound,
    and the next request fails at once with the server unreachable."""
    from comfyui_a3b.runtime import A3BError, RemoteUnreachable

    with running(llama_server_exe, default_path, tmp_path, "--ctx-size", "2048", "--parallel", "1") as dying:
        started = threading.Event()
        got = []

        def on_token(ev):
            got.append(ev.text)
            if len(got) >= 3:
                started.set()

        stream = rt.submit("Once upon a time", model=dying.url, chat=False, max_tokens=1500, sampling=_greedy(),
                           on_token=on_token)
        assert started.wait(60), "no tokens streamed"
        dying.proc.kill()
        dying.proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(A3BError) as e:
            stream.result(timeout=30)
        assert not isinstance(e.value, TimeoutError)
        assert time.monotonic() - t0 < 15
        assert "closed the connection" in str(e.value) or "not reachable" in str(e.value), e.value
        t0 = time.monotonic()
        with pytest.raises(RemoteUnreachable):
            rt.generate("Hello", model=dying.url, chat=False, max_tokens=2)
        assert time.monotonic() - t0 < 15


# -- embeddings --------------------------------------------------------------------------------------------
def test_embeddings(embedding_server, server, rt, remote_env):
    from comfyui_a3b.runtime import A3BError

    texts = ["a cat", "a kitten", "a stock market crash"]
    vecs = rt.embed(texts, model=embedding_server.url)
    assert vecs.shape == (3, 576) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2]
    local = rt.embed(texts)   # the same weights, mean pooled here
    assert np.all(np.sum(vecs * local, axis=1) > 0.99)
    # a server started without --embeddings: the server's own advice reaches the caller
    with pytest.raises(A3BError, match="--embeddings"):
        rt.embed(texts, model=server.url)


# -- fill-in-the-middle: a3b serve and the language server over llama-server -----------------------------
INFILL = {"input_prefix": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
          "input_suffix": "\n\nprint(fibonacci(10))\n", "prompt": "    if n < 2:", "n_predict": 16,
          "input_extra": [{"text": "def square(x):\n    return x * x\n", "filename": "util.py"}]}


@contextlib.contextmanager
def a3b_serve(url: str, rt):
    """`a3b serve` in this process with the remote model at `url` behind it; its root URL."""
    from comfyui_a3b.serve import Server

    srv = Server(rt.spec(url), "127.0.0.1", 0, token="t").start()
    try:
        yield srv.url[:-3]
    finally:
        srv.stop()


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, json=body, headers={"Authorization": "Bearer t"}, timeout=60, trust_env=False)


GREEDY_INFILL = {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}


def test_a3b_serve_infill_reaches_llama_servers_infill(fim_server, rt, remote_env):
    """/infill of `a3b serve` in front of a llama-server whose model has FIM tokens: the request goes
    on to the server's /infill (the answer is the server's own /infill answer, which differs from a
    completion of the prefix)."""
    body = {**GREEDY_INFILL, "input_prefix": INFILL["input_prefix"], "input_suffix": INFILL["input_suffix"],
            "prompt": INFILL["prompt"], "n_predict": 16}
    own = fim_server.post("/infill", body)["content"]
    prefix_only = fim_server.post("/v1/completions", {**GREEDY_INFILL, "model": "smol", "max_tokens": 16,
                                                       "prompt": body["input_prefix"] + body["prompt"]})
    assert own != prefix_only["choices"][0]["text"]   # else this test could not tell the two apart
    with a3b_serve(fim_server.url, rt) as root:
        r = _post(root + "/infill", body)
        assert r.status_code == 200, r.text
        assert r.json()["content"] == own


def test_a3b_serve_infill_over_a_model_without_fim_tokens(server, rt, remote_env):
    """/infill of `a3b serve` in front of a llama-server whose model has no FIM tokens (the embedded
    one; that server answers its own /infill with 501): a completion of the prefix, as `a3b serve`
    does for such a local model."""
    with a3b_serve(server.url, rt) as root:
        r = _post(root + "/infill", INFILL)
        assert r.status_code == 200, r.text
        assert r.json()["content"].strip()


def test_a3b_serve_in_front_of_llama_server(server, rt, remote_env):
    """`a3b serve` with the llama-server model behind it: a streamed chat, and /tokenize with the
    model's own token ids."""
    import openai

    with a3b_serve(server.url, rt) as root:
        client = openai.OpenAI(base_url=root + "/v1", api_key="t")
        (model,) = [m.id for m in client.models.list()]
        chunks = list(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=16, stream=True,
            temperature=0))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        text = "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"
        r = _post(root + "/tokenize", {"content": text})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == server.post("/tokenize", {"content": text})["tokens"]


@pytest_asyncio.fixture(loop_scope="function", params=["server", "fim_server"])
async def lsp_client(request):
    """The language server over the model of a llama-server (without FIM tokens, or with them)."""
    from lsp_helpers import remote_model_client

    async with remote_model_client(request.getfixturevalue(request.param).url, KEY) as c:
        yield c


async def test_language_server_over_llama_server(lsp_client):
    """Inline completions from llama-server (through /infill where the model has FIM tokens, from
    the prefix otherwise), the model named as the server names it."""
    from lsp_helpers import inline_on_sample, status

    items = await inline_on_sample(lsp_client, "file:///w/llama_server_demo.py")
    assert len(items) == 1 and items[0].strip(), items
    assert (await status(lsp_client))["model"] == "smol"
