"""One rule for an answer the context cannot hold (runtime/generation.py, cut_by_context): a prompt
that leaves no room is refused (PromptTooLong); any other request runs until max_tokens or the
context's end, whichever comes first, and an answer cut by the context's end says so
(finish_reason "length" and context_full). Every surface reports the same thing for the same
over-long request: the runtime, the CLI, `a3b serve` (OpenAI, /infill and Ollama endpoints) and the
nodes. Fast tier over the fake engine, plus the real model where it is cheap.
"""
from __future__ import annotations

import json

import httpx
import pytest

from comfyui_a3b import cli
from comfyui_a3b.nodes import generation
from comfyui_a3b.runtime import get_runtime
from comfyui_a3b.runtime.errors import PromptTooLong

MODEL = "fake://ctxfull?fim=1&delay_ms=1"
N_CTX = 64
PROMPT = "0123456789"
#: far beyond the context: the context's end comes first
LONG = 1000


@pytest.fixture(scope="module")
def spec(fake_engine):
    return get_runtime().spec(MODEL, n_ctx=N_CTX, n_parallel=1)


@pytest.fixture(scope="module")
def http(spec):
    from comfyui_a3b.serve import Server

    srv = Server(spec, "127.0.0.1", 0, name="ctx").start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30, trust_env=False) as c:
            yield c
    finally:
        srv.stop()


def test_the_runtime_computes_the_cut_once(spec):
    rt = get_runtime()
    res = rt.generate(PROMPT, model=spec, chat=False, max_tokens=LONG)
    assert (res.finish_reason, res.context_full) == ("length", True)
    assert res.n_prompt_tokens + res.n_tokens == N_CTX
    assert res.as_dict()["context_full"] is True
    room = N_CTX - res.n_prompt_tokens
    for max_tokens in (5, room):   # max_tokens first, or both at the same token: not the context's cut
        res = rt.generate(PROMPT, model=spec, chat=False, max_tokens=max_tokens)
        assert (res.finish_reason, res.context_full, res.n_tokens) == ("length", False, max_tokens)
    with pytest.raises(PromptTooLong, match="context holds"):   # no room at all: refused
        rt.generate("x" * N_CTX, model=spec, chat=False, max_tokens=LONG)


def test_every_surface_reports_the_same_cut(spec, http, capsys):
    rt = get_runtime()
    want = rt.generate(PROMPT, model=spec, chat=False, max_tokens=LONG)
    n_prompt, n_answer = want.n_prompt_tokens, want.n_tokens

    assert cli.main(["generate", PROMPT, "--model", MODEL, "--raw", "--n-ctx", str(N_CTX), "--max-tokens", str(LONG),
                     "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["finish_reason"], d["context_full"], d["n_prompt_tokens"], d["n_tokens"]) == \
        ("length", True, n_prompt, n_answer)

    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": LONG})   # not clamped, not refused
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["choices"][0]["finish_reason"], body["a3b"]["context_full"]) == ("length", True)
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (n_prompt, n_answer)
    r = http.post("/v1/completions", json={"prompt": PROMPT, "n_predict": LONG, "stream": True})
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert (chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["a3b"]) == ("length", {"context_full": True})

    r = http.post("/api/generate", json={"model": "ctx", "prompt": PROMPT, "raw": True, "stream": False,
                                         "options": {"num_predict": LONG}})
    assert r.status_code == 200, r.text
    o = r.json()
    assert (o["done_reason"], o["a3b"], o["prompt_eval_count"], o["eval_count"]) == \
        ("length", {"context_full": True}, n_prompt, n_answer)

    r = http.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")", "n_predict": LONG})
    assert r.status_code == 200, r.text
    assert r.json()["a3b"]["context_full"] is True and r.json()["stop_type"] == "limit"

    # a chat: the nodes' A3BGenerate and the chat endpoint render the same messages
    g = generation.generate(spec, PROMPT, max_new_tokens=LONG, sampling=generation.sampling_params(seed=3))
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                   "max_completion_tokens": LONG, "seed": 3}).json()
    assert (g.result.finish_reason, g.result.context_full) == ("length", True)
    assert (chat["choices"][0]["finish_reason"], chat["a3b"]["context_full"]) == ("length", True)
    assert (chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"]) == \
        (g.result.n_prompt_tokens, g.result.n_tokens)
    assert g.result.n_prompt_tokens + g.result.n_tokens == N_CTX
    assert g.note == (f"the answer stopped because the context is full ({g.result.n_prompt_tokens} prompt + "
                      f"{g.result.n_tokens} answer tokens of n_ctx {N_CTX}), before max_new_tokens; raise n_ctx "
                      "for a longer answer.")


def test_max_tokens_first_is_no_cut_anywhere(spec, http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}).json()
    assert (r["choices"][0]["finish_reason"], r["a3b"]["context_full"]) == ("length", False)
    o = http.post("/api/generate", json={"model": "ctx", "prompt": PROMPT, "raw": True, "stream": False,
                                         "options": {"num_predict": 5}}).json()
    assert o["done_reason"] == "length" and "a3b" not in o
    g = generation.generate(spec, PROMPT, max_new_tokens=2)   # the chat's template takes most of the 64 tokens
    assert (g.result.finish_reason, g.result.context_full, g.note) == ("length", False, "")
    r = http.post("/v1/completions", json={"prompt": "x" * N_CTX, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_the_remote_engine_reports_the_servers_cut(spec, http, remote_models_unloaded):
    """A model served elsewhere (here `a3b serve` itself): the server's "length" before max_tokens is
    the context's end, and the result says so as a local one does."""
    rt = get_runtime()
    url = f"http://127.0.0.1:{http.base_url.port}/v1"
    want = rt.generate(PROMPT, model=spec, chat=False, max_tokens=LONG)
    res = rt.generate(PROMPT, model=rt.spec(url), chat=False, max_tokens=LONG)
    assert (res.finish_reason, res.context_full, res.n_tokens) == ("length", True, want.n_tokens)
    res = rt.generate(PROMPT, model=rt.spec(url), chat=False, max_tokens=5)
    assert (res.finish_reason, res.context_full, res.n_tokens) == ("length", False, 5)


@pytest.mark.slow
def test_the_real_model_reports_the_cut(capsys):
    """The embedded model through the CLI and the runtime: the same numbers, the same note."""
    rt = get_runtime()
    spec = rt.spec(None, n_ctx=48, n_parallel=1)
    res = rt.generate(PROMPT, model=spec, chat=False, max_tokens=LONG,
                      sampling=generation.sampling_params(ignore_eos=True))
    assert (res.finish_reason, res.context_full, res.n_prompt_tokens + res.n_tokens) == ("length", True, 48)
    assert cli.main(["generate", PROMPT, "--raw", "--n-ctx", "48", "--max-tokens", str(LONG), "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert (f"a3b: note: the answer stopped because the context is full ({res.n_prompt_tokens} prompt + "
            f"{res.n_tokens} answer tokens of --n-ctx 48), before --max-tokens") in err, err
