"""A model served by an OpenAI-compatible server, behind the same surface as a local LoadedModel.

A remote server decodes and samples on its own, so the runtime's token-level worker (worker.py) does
not apply: `RemoteModel` takes requests with the same `submit` / `embed_tokens` calls and streams
the same `TokenEvent`s, from one thread per running request. Everything the callers rely on maps as
follows:

* text: the runtime's requests are text or token ids of `TextVocab`, whose ids are pieces of text
  interned in this process (exact round trip, no network call): prompts go out as text;
* chat: a prompt that `render_chat` produced goes to `/v1/chat/completions` with its messages, so
  the server applies the model's own template;
* fill-in-the-middle: `TextVocab` has FIM ids when the server has llama-server's `/infill`, and a
  prompt built with them (as the language server builds one) goes to `/infill`;
* stop strings, confidence spans and the low-confidence marker: the same `TextAssembler` as local
  generation, with each token's entropy estimated from the server's `top_logprobs`;
* cancellation: the response is closed between two streamed tokens, which a server sees as a
  disconnect and stops generating;
* embeddings: `/v1/embeddings`; per-token vectors (llama_cpp.server's answer for models without
  pooling) are pooled here.
"""
from __future__ import annotations

import collections
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from .. import chat as chatmod
from ..engine import ModelInfo
from ..errors import (A3BError, Cancelled, InvalidRequest, ModelNotFound, ModelUnloaded, PromptTooLong,
                      RemoteProtocolError)
from ..generation import GenerationRequest, GenerationResult, GenerationStream, TextAssembler, TokenEvent
from ..options import POOLINGS, LoadSpec
from .client import DONE, Client, RemoteRef, check_allowed, parse_ref

log = logging.getLogger("a3b.remote")

BOS, EOS, FIM_PRE, FIM_SUF, FIM_MID = 1, 2, 3, 4, 5
FIRST_PIECE = 16
#: Pieces as a pre-tokenizer cuts text: a word (or up to 8 letters of one) with its leading space, up
#: to 3 digits, one punctuation mark, a run of spaces. Their count is the token estimate for servers
#: without a tokenize endpoint (about 1-1.5 real tokens per piece for English text and code).
_PIECE = re.compile(r" ?[^\W\d_]{1,8}| ?\d{1,3}| ?[^\w\s]|\s+(?!\S)|\s|.", re.S)


class TextVocab:
    """Token ids that stand for pieces of text, interned in this process. Any thread may call it."""

    def __init__(self, fim: bool):
        self.add_bos = False
        self.bos, self.eos = -1, EOS
        self.fim = fim
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = [""] * FIRST_PIECE
        self._lock = threading.Lock()

    @property
    def n_vocab(self) -> int:
        return len(self._pieces)

    def intern(self, piece: str) -> int:
        i = self._ids.get(piece)
        if i is None:
            with self._lock:
                i = self._ids.get(piece)
                if i is None:
                    i = self._ids[piece] = len(self._pieces)
                    self._pieces.append(piece)
        return i

    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        return [self.intern(m.group()) for m in _PIECE.finditer(text)]

    def text_of(self, token: int) -> str:
        return self._pieces[token] if 0 <= token < len(self._pieces) else ""

    def piece(self, token: int) -> bytes:
        return self.text_of(token).encode("utf-8", "surrogatepass")

    def detokenize(self, tokens: list[int]) -> str:
        return "".join(self.text_of(t) for t in tokens)

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def token_text(self, token: int) -> str:
        return self.text_of(token)

    def special_tokens(self) -> dict[str, int]:
        fim = (FIM_PRE, FIM_SUF, FIM_MID) if self.fim else (-1, -1, -1)
        return {"bos": -1, "eos": EOS, "eot": -1, "fim_pre": fim[0], "fim_suf": fim[1], "fim_mid": fim[2],
                "fim_pad": -1, "fim_rep": -1, "fim_sep": -1}


class RemoteWeights:
    """What `load_weights` found out about the server: its model, context, endpoints."""

    size_bytes = 0

    def __init__(self, ref: RemoteRef, client: Client, info: ModelInfo, vocab: TextVocab, features: dict[str, Any]):
        self.ref, self.client, self.info, self.vocab, self.features = ref, client, info, vocab, features

    def free(self) -> None:
        self.client.close()


def probe(ref: RemoteRef) -> RemoteWeights:
    """Ask the server what it serves and which of the endpoints beyond the OpenAI API it has."""
    client = Client(ref)
    try:
        listing = client.get("/models")
        if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
            raise RemoteProtocolError(f"The server at {ref.base} is not an OpenAI-compatible server: GET /models "
                                      "did not answer with a model list. Check the URL (usually ending in /v1).")
        ids = [m.get("id") for m in listing["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
        if ref.model is not None:
            if ref.model not in ids:
                raise ModelNotFound(f"The server at {ref.base} does not serve {ref.model!r}; it serves: "
                                    f"{', '.join(ids) or 'nothing'}. Put one of those after '#'.")
            name = ref.model
        elif len(ids) == 1:
            name = ids[0]
        elif ids:
            raise InvalidRequest(f"The server at {ref.base} serves several models ({', '.join(ids)}); add the one "
                                 f"to use after '#', e.g. {ref.base}#{ids[0]}.")
        else:
            raise ModelNotFound(f"The server at {ref.base} serves no model yet.")
        props = client.get("/props", root=True, expect_json=False) if _has(client, "/props") else None
        props = props if isinstance(props, dict) else {}
        n_ctx = int((props.get("default_generation_settings") or {}).get("n_ctx") or props.get("n_ctx") or 0)
        tokenize = None
        if isinstance(client.try_post("/tokenize", {"content": "a"}, root=True), dict):
            tokenize = "/tokenize"
        elif isinstance(client.try_post("/extras/tokenize", {"input": "a"}, root=True), dict):
            tokenize = "/extras/tokenize"
        features = {
            "server": "llama-server" if props else ("llama_cpp.server" if tokenize == "/extras/tokenize" else "openai"),
            "infill": bool(props),       # llama-server (and a3b serve) answer /props and /infill
            "tokenize": tokenize,
            "n_ctx": n_ctx,              # the server's context per request, when it says
        }
        info = ModelInfo(name=name, path=ref.url, architecture="remote", file_type=None, n_ctx_train=0,
                         n_vocab=0, n_embd=0, n_layer=0, size_bytes=0,
                         chat_template=props.get("chat_template") or None,
                         special_tokens=TextVocab(features["infill"]).special_tokens(), add_bos=False,
                         engine=f"remote: {features['server']} at {ref.base}")
        missing = [what for what, ok in (("fill-in-the-middle (/infill)", features["infill"]),
                                         ("exact token counts (/tokenize)", tokenize)) if not ok]
        if missing:
            log.info("%s at %s cannot give: %s; prompts use a prefix, counts an estimate",
                     features["server"], ref.base, ", ".join(missing))
        return RemoteWeights(ref, client, info, TextVocab(features["infill"]), features)
    except BaseException:
        client.close()
        raise


def _has(client: Client, path: str) -> bool:
    try:
        r = client.http.get(client.url(path, root=True))
    except httpx.HTTPError as e:
        raise client.unreachable(e) from None
    return r.status_code == 200


class RemoteModel:
    """A remote model with worker.LoadedModel's public surface (what the store hands out)."""

    def __init__(self, weights: RemoteWeights, spec: LoadSpec):
        self.weights = weights
        self.info = weights.info
        self.vocab: TextVocab = weights.vocab
        self.client = weights.client
        self.features = weights.features
        self.spec = spec
        self.name = self.info.name
        server_ctx = self.features.get("n_ctx") or 0
        self.n_ctx_seq = min(spec.n_ctx, server_ctx) if server_ctx else spec.n_ctx
        self.stats: collections.Counter = collections.Counter()
        self.created = time.time()
        self.last_used = time.monotonic()
        self.closed = threading.Event()
        self._closing: str | None = None
        self._lock = threading.Lock()
        self._running: set[GenerationStream] = set()
        self._chats: collections.OrderedDict[str, list[dict]] = collections.OrderedDict()

    # -- the LoadedModel surface ---------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._closing

    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        return self.vocab.tokenize(text)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._running)

    def wake(self) -> None:
        """Cancellations are seen between streamed tokens; nothing to wake."""

    def close(self, reason: str = "unloaded", wait: bool = True) -> None:
        with self._lock:
            self._closing = self._closing or reason
            running = list(self._running)
        for s in running:
            s.cancel(f"unloaded: {reason}")
        # Nothing here needs the requests' threads to end first: each ends at its next event, or
        # when the store frees the weights (the connection pool) and its read fails, and then
        # reports ModelUnloaded. A stalled server must not hold up an unload.
        self.closed.set()

    def render_chat(self, msgs: list[dict[str, str]], template: str | None = None) -> str:
        """The chat prompt as text (for token budgets); remembered, so that submitting it sends the
        messages to /v1/chat/completions and the server applies the model's own template."""
        text = chatmod.render(msgs, gguf_template=self.info.chat_template, template=template, bos="", eos="")
        if not template:
            with self._lock:
                self._chats[text] = [dict(m) for m in msgs]
                self._chats.move_to_end(text)
                while len(self._chats) > 256:
                    self._chats.popitem(last=False)
        return text

    def count_tokens(self, text: str) -> tuple[int, bool]:
        """Tokens of `text`: (count, exact). Exact through the server's tokenize endpoint when it has
        one, else the estimate of TextVocab."""
        path = self.features.get("tokenize")
        if path:
            body = {"content": text} if path == "/tokenize" else {"input": text}
            try:
                out = self.client.post(path, body, root=True)
                return len(out.get("tokens", [])), True
            except A3BError as e:
                log.debug("tokenize failed, estimating: %s", e)
        return len(self.vocab.tokenize(text)), False

    def submit(self, request: GenerationRequest,
               on_token: Callable[[TokenEvent], None] | None = None) -> GenerationStream:
        request.validate()
        tokens = list(request.prompt_tokens) if request.prompt_tokens is not None else None
        route, body = self._route(request, tokens)
        prompt_text = body.get("prompt") or body.get("input_prefix", "") + body.get("input_suffix", "") + \
            "".join(m["content"] for m in body.get("messages", []) if isinstance(m.get("content"), str))
        if not prompt_text.strip() and route != "/infill":
            raise InvalidRequest("The prompt is empty; give some text to continue.")
        n_prompt, exact = self.count_tokens(prompt_text)
        if n_prompt >= self.n_ctx_seq:
            raise PromptTooLong(f"The prompt has {n_prompt} tokens{'' if exact else ' (estimated)'} but the context "
                                f"holds {self.n_ctx_seq} (including the answer). Shorten the prompt, or load the "
                                "model with a larger n_ctx (and the server with a context that large).")
        stream = GenerationStream(request, on_token)
        with self._lock:
            if self._closing:
                raise ModelUnloaded(f"{self.name} is being unloaded ({self._closing}); load it again.")
            self._running.add(stream)
            self.stats["submitted"] += 1
        threading.Thread(target=self._run, args=(stream, route, body, n_prompt), daemon=True,
                         name=f"a3b-remote-{stream.id}").start()
        return stream

    def embed_tokens(self, token_lists: list[list[int]], pooling: str = "mean", normalize: bool = True,
                     priority: int = 0, timeout: float | None = None,
                     cancelled: Callable[[], bool] | None = None) -> np.ndarray:
        if pooling not in POOLINGS:
            raise InvalidRequest(f"Unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
        texts = [self.vocab.detokenize(t) for t in token_lists]
        for i, t in enumerate(texts):
            if not t:
                raise InvalidRequest(f"Text #{i} is empty; embeddings need at least one token.")
        rows: list[np.ndarray] = []
        first = 0
        while first < len(texts):   # small packs: a cancel is seen between them
            if cancelled is not None and cancelled():
                raise Cancelled("Embedding cancelled.")
            if self._closing:
                raise ModelUnloaded(f"{self.name} was unloaded ({self._closing}) before the embedding finished.")
            n = 1 if self.features.get("embed_one_by_one") else 8
            vecs = self._embed_pack(texts[first:first + n])
            if len(vecs) > 1 and any(v.ndim == 2 for v in vecs):
                # per-token vectors for several texts: llama_cpp.server (0.3.36) slices them wrongly
                # for all but the first text, so such a server gets one text per request
                log.info("%s answers per-token embeddings; embedding one text per request", self.client.ref.base)
                self.features["embed_one_by_one"] = True
                continue
            rows.extend(_pool(v, pooling) for v in vecs)
            first += len(vecs)
        self.stats["embedded_texts"] += len(texts)
        self.last_used = time.monotonic()
        out_arr = np.stack(rows)
        if normalize:
            norms = np.linalg.norm(out_arr, axis=1, keepdims=True)
            out_arr = out_arr / np.where(norms > 0, norms, 1.0)
        return out_arr

    def _embed_pack(self, texts: list[str]) -> list[np.ndarray]:
        out = self.client.post("/embeddings", {"input": texts, "model": self.name})
        data = out.get("data") if isinstance(out, dict) else None
        if not isinstance(data, list) or len(data) != len(texts) or not all(isinstance(d, dict) for d in data):
            raise RemoteProtocolError(f"The server at {self.client.ref.base} answered /embeddings without one "
                                      "vector per text.")
        try:
            return [np.asarray(d.get("embedding"), dtype=np.float32)
                    for d in sorted(data, key=lambda d: d.get("index", 0))]
        except (TypeError, ValueError) as e:
            raise RemoteProtocolError(f"The server at {self.client.ref.base} answered /embeddings with something "
                                      f"that is not a vector ({e}).") from None

    # -- requests --------------------------------------------------------------------------------
    def _route(self, req: GenerationRequest, tokens: list[int] | None) -> tuple[str, dict]:
        sp = req.sampling
        body: dict[str, Any] = {
            "model": self.name, "max_tokens": req.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
            "top_k": sp.top_k, "min_p": sp.min_p, "repeat_penalty": sp.repeat_penalty, "stream": True,
        }
        if sp.seed is not None:
            body["seed"] = sp.seed
        if req.stop:
            body["stop"] = list(req.stop)
        n_top = req.logprobs if req.logprobs is not None else (5 if req.confidence.enabled else None)
        if tokens is not None and self.vocab.fim and FIM_PRE in tokens and FIM_SUF in tokens and FIM_MID in tokens:
            i, j, k = tokens.index(FIM_PRE), tokens.index(FIM_SUF), tokens.index(FIM_MID)
            if i < j < k:
                body.update(input_prefix=self.vocab.detokenize(tokens[i + 1:j]),
                            input_suffix=self.vocab.detokenize(tokens[j + 1:k]),
                            prompt=self.vocab.detokenize(tokens[k + 1:]), n_predict=req.max_tokens)
                if n_top:
                    body["n_probs"] = n_top
                return "/infill", body
        text = self.vocab.detokenize(tokens) if tokens is not None else req.prompt
        with self._lock:
            msgs = self._chats.get(text)
        if msgs is not None:
            body["messages"] = msgs
            if n_top is not None:
                body.update(logprobs=True, top_logprobs=n_top)
            return "/chat/completions", body
        body["prompt"] = text
        if n_top is not None:
            body["logprobs"] = n_top
        return "/completions", body

    def _run(self, stream: GenerationStream, route: str, body: dict, n_prompt: int) -> None:
        req = stream.request
        asm = TextAssembler(req.stop, req.confidence)
        toks: list[int] = []
        t_first = t_last = None
        reason, error = "stop", None
        try:
            url = self.client.url(route, root=route == "/infill")
            with self.client.http.stream("POST", url, json=body) as r:
                self.client.raise_for(r)
                ended = False
                for ev in self.client.events(r):
                    if stream.cancelled:
                        reason = "cancelled"
                        break
                    if ev is DONE:
                        ended = True
                        break
                    text, lp, finish = _delta(ev)
                    if text:
                        now = time.perf_counter()
                        t_first = t_first or now
                        t_last = now
                        ent = entropy_of(lp[1]) if lp and req.confidence.enabled else None
                        toks.append(self.vocab.intern(text))
                        out = asm.add(text.encode("utf-8", "surrogatepass"), ent)
                        if req.logprobs is not None and lp:
                            stream._emit(TokenEvent(out, toks[-1], ent, text, lp[0], lp[1][:req.logprobs]))
                        else:
                            stream._emit(TokenEvent(out, toks[-1], ent))
                        if len(toks) >= req.max_tokens and not asm.stopped:
                            reason = "length"
                    if finish:
                        reason = "length" if finish == "length" else "stop"
                        ended = True
                        break
                    if asm.stopped or len(toks) >= req.max_tokens:
                        ended = True
                        break
                if not ended and not stream.cancelled:
                    raise RemoteProtocolError(
                        f"The server at {self.client.ref.base} ended its answer without finishing it, after "
                        f"{len(toks)} tokens. Check the server's log: llama_cpp.server does this when the prompt is "
                        "longer than its context.")
        except A3BError as e:
            reason, error = "error", e
        except (httpx.HTTPError, OSError, ValueError) as e:
            reason, error = "error", self.client.unreachable(e)
        except BaseException as e:
            log.exception("remote request failed")
            reason, error = "error", RemoteProtocolError(f"{self.client.ref.base}: {type(e).__name__}: {e}")
        if stream.cancelled:   # also when closing the connection made the read fail
            reason, error = "cancelled", None
        tail = asm.flush()
        if tail:
            stream._emit(TokenEvent(tail, -1, None))
        text, spans = asm.final_text()
        end = time.perf_counter()
        result = GenerationResult(
            text=text, tokens=toks, finish_reason=reason, n_prompt_tokens=n_prompt, n_cached_prompt_tokens=0,
            seed=req.sampling.seed if req.sampling.seed is not None else -1, spans=spans,
            entropies=list(asm.entropies),
            time_to_first_token=(t_first - stream.submitted_at) if t_first else 0.0,
            total_time=end - stream.submitted_at, decode_time=(t_last - t_first) if t_first and t_last else 0.0)
        if reason == "cancelled":
            if stream.cancel_reason.startswith("unloaded"):
                error = ModelUnloaded(f"{self.name} was unloaded while this request ran; "
                                      f"{len(toks)} tokens were generated before it stopped.")
            else:
                error = Cancelled(f"Generation cancelled after {len(toks)} tokens.")
        if error is not None:
            error.partial = result   # the text so far travels with the error, as for local models
        self.stats[f"finished_{reason}"] += 1
        self.stats["generated_tokens"] += len(toks)
        self.last_used = time.monotonic()
        with self._lock:
            self._running.discard(stream)
        stream._finish(result if error is None else None, error)


def _delta(ev: dict) -> tuple[str, tuple[float, list[tuple[str, float]]] | None, str | None]:
    """(new text, (logprob, top alternatives) or None, finish reason) of one streamed event: a
    completion, a chat completion, or llama-server's /infill format."""
    choices = ev.get("choices")
    if isinstance(choices, list):
        if not choices:
            return "", None, None
        c = choices[0] if isinstance(choices[0], dict) else {}
        finish = c.get("finish_reason")
        if isinstance(c.get("delta"), dict):
            text = c["delta"].get("content") or ""
            lp = c.get("logprobs") or {}
            content = lp.get("content") if isinstance(lp, dict) else None
            if content and isinstance(content[0], dict):
                first = content[0]
                top = [(t.get("token", ""), float(t.get("logprob", 0.0))) for t in first.get("top_logprobs") or []]
                return text, (float(first.get("logprob", 0.0)), top), finish
            return text, None, finish
        text = c.get("text") or ""
        lp = c.get("logprobs")
        if isinstance(lp, dict) and lp.get("top_logprobs"):
            tops = lp["top_logprobs"][0] or {}
            chosen = (lp.get("token_logprobs") or [0.0])[0]
            top = sorted(((str(k), float(v)) for k, v in tops.items()), key=lambda kv: -kv[1])
            return text, (float(chosen if chosen is not None else 0.0), top), finish
        return text, None, finish
    if "content" in ev:   # llama-server's native format (/infill, /completion)
        probs = ev.get("completion_probabilities") or []
        lp = None
        if probs and isinstance(probs[0], dict):
            p = probs[0]
            top = [(t.get("token", ""),
                    float(t["logprob"]) if "logprob" in t else math.log(max(t.get("prob", 1e-9), 1e-9)))
                   for t in p.get("top_logprobs") or p.get("probs") or []]
            lp = (float(p.get("logprob", top[0][1] if top else 0.0)), top)
        return ev.get("content") or "", lp, ("stop" if ev.get("stop") else None)
    raise RemoteProtocolError(f"An event without choices or content: {str(ev)[:80]}")


def entropy_of(top: list[tuple[str, float]]) -> float | None:
    """Entropy (nats) estimated from the top alternatives' log-probabilities: their own terms, plus
    the probability left over counted as one more outcome (a lower bound of the true entropy; with 5
    alternatives it follows the local measure closely where it matters, a flat distribution)."""
    if not top:
        return None
    ps = [math.exp(v) for _, v in top if v is not None and math.isfinite(v)]
    h = -sum(p * math.log(p) for p in ps if p > 0)
    rest = 1.0 - sum(ps)
    if rest > 1e-9:
        h -= rest * math.log(rest)
    return h


def _pool(vec: np.ndarray, pooling: str) -> np.ndarray:
    """A pooled vector of one text: as given when the server pooled, else pooled here."""
    if vec.ndim == 1:
        return vec
    if vec.ndim != 2 or not len(vec):
        raise RemoteProtocolError("An embedding that is neither a vector nor a list of token vectors.")
    return vec.mean(axis=0) if pooling == "mean" else vec[0] if pooling == "cls" else vec[-1]


class RemoteEngine:
    """The engine for `http(s)://HOST:PORT/v1[#MODEL]` model references."""

    name = "remote"

    def __init__(self):
        self._prepared: dict[tuple, RemoteWeights] = {}
        self._lock = threading.Lock()

    def prepare(self, spec: LoadSpec) -> None:
        """Probe the server before the store takes its lock; load_weights then uses the answer."""
        w = probe(parse_ref(spec.path))
        with self._lock:
            old = self._prepared.pop(self.weights_key(spec), None)
            self._prepared[self.weights_key(spec)] = w
        if old is not None:
            old.free()

    def check_reference(self, ref: str, restrict: bool) -> None:
        check_allowed(ref, restrict)

    def check(self, spec: LoadSpec) -> None:
        parse_ref(spec.path)

    def weights_key(self, spec: LoadSpec) -> tuple:
        r = parse_ref(spec.path)
        return (r.base, r.model)

    def file_bytes(self, spec: LoadSpec) -> int:
        return 0

    def kv_bytes(self, weights, spec: LoadSpec) -> int:
        return 0

    def load_weights(self, spec: LoadSpec) -> RemoteWeights:
        with self._lock:
            w = self._prepared.pop(self.weights_key(spec), None)
        return w if w is not None else probe(parse_ref(spec.path))

    def open(self, weights, spec: LoadSpec):
        raise NotImplementedError("a remote model is opened with open_model")

    def open_model(self, weights: RemoteWeights, spec: LoadSpec) -> RemoteModel:
        return RemoteModel(weights, spec)

    def gpus(self) -> list:
        return []
