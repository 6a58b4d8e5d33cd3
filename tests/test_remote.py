"""The remote engine against a scripted OpenAI-compatible server (fast tier): which endpoint each
kind of prompt reaches and with what, and what a broken or hostile server gets: a timeout that
pings cannot defeat, bounded answers, embeddings checked, stream fields checked."""
from __future__ import annotations

import itertools
import logging
import math
import time

import pytest
from fakeopenai import FakeOpenAI, event, forever, json_reply, sse_reply, text_event

from comfyui_a3b.runtime import (ChatPrompt, ContextChunk, InfillPrompt, RemoteProtocolError, RemoteUnreachable,
                                 TextPrompt, TokenPrompt, get_runtime)
from comfyui_a3b.runtime.remote import MAX_ANSWER_BYTES, MAX_EVENT_BYTES

HELLO = sse_reply([text_event("Hel"), text_event("lo", "stop"), b"data: [DONE]\n\n"])


@pytest.fixture()
def rt():
    rt = get_runtime()
    yield rt
    for e in rt.store.loaded():
        if e.spec.path.startswith("http"):
            rt.unload(e.spec)


def _server(**routes) -> FakeOpenAI:
    return FakeOpenAI({"/v1/" + k.replace("__", "/"): v for k, v in routes.items()})


# -- prompts reach the endpoint made for them ------------------------------------------------------
def test_chat_goes_to_chat_completions_with_its_messages_and_variables(rt):
    chat = sse_reply([event({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]}),
                      b"data: [DONE]\n\n"])
    with _server(chat__completions=lambda b: chat) as srv:
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        res = rt.generate(ChatPrompt(msgs, variables={"enable_thinking": False}), model=srv.url, max_tokens=5)
        assert res.text == "Hi" and res.tokens is None and res.n_tokens == 1
        path, body = srv.requests[-1]
        assert path == "/v1/chat/completions" and body["messages"] == msgs
        assert body["chat_template_kwargs"] == {"enable_thinking": False}


def test_text_tokens_and_infill_without_an_infill_endpoint_go_to_completions(rt):
    with _server(completions=lambda b: HELLO) as srv:
        assert rt.generate("Once", model=srv.url, chat=False, max_tokens=5).text == "Hello"
        assert srv.requests[-1] == ("/v1/completions", {**srv.requests[-1][1], "prompt": "Once"})
        rt.generate(TokenPrompt([1, 2, 3]), model=srv.url, max_tokens=5)
        assert srv.requests[-1][1]["prompt"] == [1, 2, 3]
        # no /props: the server has no /infill, so the prefix (after the chunks) is completed
        assert not rt.load(rt.spec(srv.url)).supports_fim
        rt.generate(InfillPrompt("def f():", "\n", "    ", [ContextChunk("a.py", "import os")]), model=srv.url,
                    max_tokens=5)
        assert srv.requests[-1][1]["prompt"] == "import os\ndef f():    "


def _llama_server_infill(fim: bool, answer):
    """/infill as llama-server answers it: 501 for a model without FIM tokens, then 400 for fields of
    the wrong type, and `answer` otherwise."""
    def infill(body):
        if not fim:
            return json_reply({"error": {"code": 501, "message": "Infill is not supported by this model: prefix "
                                         "token is missing. ", "type": "not_supported_error"}}, 501)
        if not isinstance(body.get("input_extra", []), list):
            return json_reply({"error": {"code": 400, "message": '"input_extra" must be an array',
                                         "type": "invalid_request_error"}}, 400)
        return answer
    return infill


def test_infill_goes_to_infill_with_its_parts(rt):
    infill = sse_reply([event({"content": "x = 1", "stop": False}), event({"content": "", "stop": True})])
    with FakeOpenAI({"/props": lambda b: json_reply({"default_generation_settings": {"n_ctx": 512}}),
                     "/infill": _llama_server_infill(True, infill)}) as srv:
        m = rt.load(rt.spec(srv.url))
        assert m.supports_fim and m.n_ctx_seq == 512
        res = rt.generate(InfillPrompt("a", "b", "c", [ContextChunk("u.py", "import os")]), model=srv.url,
                          max_tokens=8)
        assert res.text == "x = 1"
        path, body = srv.requests[-1]
        assert path == "/infill" and (body["input_prefix"], body["input_suffix"], body["prompt"]) == ("a", "b", "c")
        assert body["input_extra"] == [{"filename": "u.py", "text": "import os"}]


def test_infill_on_a_llama_server_model_without_fim_tokens_completes_the_prefix(rt):
    """llama-server has /props and /infill whatever the model, and refuses /infill (501) where the
    model has no FIM tokens: such a model is no FIM model here, and its infill prompts are completed."""
    with FakeOpenAI({"/props": lambda b: json_reply({"default_generation_settings": {"n_ctx": 512}}),
                     "/infill": _llama_server_infill(False, None), "/v1/completions": lambda b: HELLO}) as srv:
        m = rt.load(rt.spec(srv.url))
        assert not m.supports_fim
        res = rt.generate(InfillPrompt("def f():", "\n", "    ", [ContextChunk("a.py", "import os")]),
                          model=srv.url, max_tokens=5)
        assert res.text == "Hello"
        assert srv.requests[-1] == ("/v1/completions", {**srv.requests[-1][1], "prompt": "import os\ndef f():    "})


def test_token_counts_come_from_the_servers_tokenize_else_an_estimate(rt):
    tokenize = lambda b: json_reply({"tokens": list(range(len(b["content"])))})   # noqa: E731 - one per char
    with FakeOpenAI({"/tokenize": tokenize}) as srv:
        m = rt.load(rt.spec(srv.url))
        assert m.tokenize("abc") == [0, 1, 2]
        assert m.count_tokens(TextPrompt("abcdef")) == 6
        assert m.count_tokens(TextPrompt("abcdef"), exact=False) == 1     # the estimate: one word
    with _server() as srv:
        m = rt.load(rt.spec(srv.url))
        assert m.count_tokens(TextPrompt("two words")) == 2
        with pytest.raises(Exception, match="no tokenize endpoint"):
            m.tokenize("abc")


# -- a server cannot hold a request past the timeout --------------------------------------------------
@pytest.mark.parametrize("keepalive", [b": ping\n\n", b'data: {"choices": []}\n\n'])
def test_the_timeout_bounds_the_time_without_a_token_whatever_else_arrives(rt, monkeypatch, keepalive):
    monkeypatch.setenv("A3B_REMOTE_TIMEOUT", "1")
    with _server(completions=lambda b: sse_reply(itertools.chain([text_event("a")], forever(keepalive, 0.05)))) as srv:
        t0 = time.monotonic()
        stream = rt.submit("x", model=srv.url, chat=False, max_tokens=50)
        with pytest.raises(RemoteUnreachable, match="no token for 1 s") as e:
            stream.result(20)
        assert time.monotonic() - t0 < 10 and e.value.partial.text == "a"


# -- what a server sends is bounded and checked ---------------------------------------------------
def test_a_huge_answer_is_refused(rt):
    huge = lambda b: json_reply({"object": "list", "data": [{"id": "m"}], "pad": "x" * (MAX_ANSWER_BYTES + 1)})  # noqa: E731
    with FakeOpenAI({"/v1/models": huge}) as srv:
        with pytest.raises(RemoteProtocolError, match="more than 16 MB"):
            rt.load(rt.spec(srv.url))


def test_a_huge_token_is_refused(rt):
    big = b"data: " + b'{"choices": [{"text": "' + b"x" * MAX_EVENT_BYTES + b'"}]}\n\n'
    with _server(completions=lambda b: sse_reply([text_event("a"), big[:1 << 20], big[1 << 20:]])) as srv:
        with pytest.raises(RemoteProtocolError, match="event longer than 4 MB") as e:
            rt.generate("x", model=srv.url, chat=False, max_tokens=5)
        assert e.value.partial.text == "a"


@pytest.mark.parametrize("vectors,match", [
    ([[0.1, 0.2], [0.1, 0.2, 0.3]], "different lengths"),
    ([[0.1, math.nan], [0.1, 0.2]], "NaN or infinite"),
])
def test_bad_embeddings_are_a_clear_error(rt, vectors, match):
    answer = lambda b: json_reply({"data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)]})  # noqa: E731
    with _server(embeddings=answer) as srv:
        with pytest.raises(RemoteProtocolError, match=match):
            rt.embed(["a", "b"], model=srv.url)


def test_embedded_tokens_are_the_servers_usage_or_an_estimate(rt):
    """What an API reports as the input tokens of an embedding: the server's own count where its
    answer has one (OpenAI's usage.prompt_tokens), else an estimate; no /tokenize request either way."""
    rows = lambda b: [{"index": i, "embedding": [0.6, 0.8]} for i in range(len(b["input"]))]  # noqa: E731
    with _server(embeddings=lambda b: json_reply({"data": rows(b), "usage": {"prompt_tokens": 7}})) as srv:
        rt.load(rt.spec(srv.url))   # the probe asks which endpoints the server has, /tokenize among them
        probed = len(srv.requests)
        got = rt.embed_counted(["a cat", "a kitten"], model=srv.url)
        assert got.n_tokens == 7 and got.vectors.shape == (2, 2)
        assert [path for path, _ in srv.requests[probed:]] == ["/v1/embeddings"]
    with _server(embeddings=lambda b: json_reply({"data": rows(b)})) as srv:
        assert rt.embed_counted(["a cat", "a kitten"], model=srv.url).n_tokens == 4   # an estimate: 2 + 2


def test_an_unknown_pooling_is_refused_by_both_engines_alike(rt, fake_engine):
    """The pooling option's own check (options.POOLING) in the remote and the local engine: the
    same words, before anything is sent or queued."""
    from comfyui_a3b.runtime import InvalidRequest

    with _server(embeddings=lambda b: json_reply({"data": []})) as srv:
        with pytest.raises(InvalidRequest) as remote:
            rt.embed(["a"], model=srv.url, pooling="max")
        assert not [path for path, _ in srv.requests if path.endswith("embeddings")]
    with pytest.raises(InvalidRequest) as local:
        rt.embed(["a"], model="fake://m", pooling="max")
    assert str(remote.value) == str(local.value) == "pooling must be one of mean, cls, last; got 'max'"


@pytest.mark.parametrize("texts,pooling,words", [
    (["a", ""], "mean", "Item #1 to embed is empty; embeddings need at least one token."),
    ([""], "mean", "Item #0 to embed is empty; embeddings need at least one token."),
    ([], "mean", "Nothing to embed: give at least one text."),
    (["ok", 3], "mean", "Item #1 to embed is a int, not text."),
    (["ok", "a\ud800b"], "mean", "Item #1 to embed is not valid Unicode: surrogates not allowed at character 1 "
                                  "('a' ...). Remove or replace that character."),
    (["a"], "max", "pooling must be one of mean, cls, last; got 'max'"),
])
def test_a_bad_embedding_input_gets_the_same_error_from_both_engines(rt, fake_engine, texts, pooling, words):
    """What no engine embeds is refused once, by the runtime, in the same words whatever runs the
    model, before anything is sent or queued."""
    from comfyui_a3b.runtime import InvalidRequest

    with _server(embeddings=lambda b: json_reply({"data": []})) as srv:
        with pytest.raises(InvalidRequest) as remote:
            rt.embed(texts, model=srv.url, pooling=pooling)
        assert not [path for path, _ in srv.requests if path.endswith("embeddings")]
    backend = rt.load(rt.spec("fake://m")).backend
    embedded = list(backend.embedded)
    with pytest.raises(InvalidRequest) as local:
        rt.embed(texts, model="fake://m", pooling=pooling)
    assert str(remote.value) == str(local.value) == words
    assert backend.embedded == embedded


def test_a_remote_model_refuses_drafts_made_here(rt):
    """A server drafts by itself, if at all: a draft model or MTP layers are for models run here."""
    from comfyui_a3b.runtime import InvalidRequest

    with _server() as srv:
        for mode in ("mtp", "draft:fake://d"):
            with pytest.raises(InvalidRequest, match=f"runs in another engine; speculative={mode[:5].rstrip(':')} "
                                                     "drafts for a model run here"):
                rt.load(rt.spec(srv.url, speculative=mode))
        assert not [e for e in rt.store.loaded() if e.spec.path == srv.url]


@pytest.mark.parametrize("bad,match", [
    ({"choices": [{"index": 0, "text": 5}]}, r"'text' is int"),
    ({"choices": [{"index": 0, "delta": {"content": ["x"]}}]}, r"'content' is list"),
    ({"choices": [{"index": 0, "text": "a", "logprobs": {"token_logprobs": ["high"], "top_logprobs": [{"a": -1}]}}]},
     r"token logprob is str"),
    ({"choices": [{"index": 0, "text": "a", "logprobs": {"token_logprobs": [-1], "top_logprobs": [{"a": "low"}]}}]},
     r"top logprob is str"),
])
def test_a_wrong_field_in_a_stream_is_one_clear_error(rt, caplog, bad, match):
    reply = lambda b: sse_reply([event(bad)])   # noqa: E731
    with _server(completions=reply, chat__completions=reply) as srv:
        with caplog.at_level(logging.DEBUG, logger="a3b"):
            with pytest.raises(RemoteProtocolError, match=match) as e:
                rt.generate("x", model=srv.url, chat="delta" in str(bad), max_tokens=5)
        assert "not reachable" not in str(e.value)
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_the_generate_nodes_defaults_run_over_a_remote_model(rt, monkeypatch):
    """A3BGenerate's automatic reasoning budget is for models decoded here: over a remote server (which
    cannot close a reasoning block at a budget) the node's defaults still run."""
    from comfyui_a3b.nodes import core, defs

    with _server(chat__completions=lambda b: HELLO) as srv:
        monkeypatch.setenv("A3B_REMOTE_MODELS", srv.url)
        handle = core.load_model(srv.url)
        (text, _, _), _ = defs.GENERATE.call("2", **{**defs.GENERATE.defaults(), "model": handle, "prompt": "Hi"})
        assert text == "Hello"
        assert "reasoning_budget" not in srv.requests[-1][1]


@pytest.mark.parametrize("kw, message", [
    (dict(thinking="on", reasoning_budget=0), "contradicts itself"),
    (dict(thinking="off", variables={"enable_thinking": True}), "contradicts the template variable"),
])
def test_a_remote_model_refuses_thinking_settings_as_the_local_one_does(rt, kw, message):
    """The same rule in both engines (thinking.asks_off, thinking.switch), refused before the request is sent."""
    from comfyui_a3b.runtime import InvalidRequest

    msgs = [{"role": "user", "content": "Hi"}]
    with _server(chat__completions=lambda b: HELLO) as srv:
        prompt = ChatPrompt(msgs, variables=kw.pop("variables", {}))
        with pytest.raises(InvalidRequest, match=message):
            rt.generate(prompt, model=srv.url, max_tokens=5, **kw)
        assert not [path for path, _ in srv.requests if path.endswith("completions")]
