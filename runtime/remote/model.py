"""A model served by an OpenAI-compatible server: the remote engine's `Model` (engine.py).

A remote server renders, tokenizes, decodes and samples on its own, so the runtime's token-level
worker (worker.py) does not apply: `RemoteModel` sends each request as it is (wire.py says which
prompt goes to which endpoint) and streams the server's answer as `TokenEvent`s, from one thread per
running request. What the callers rely on maps as follows:

* stop strings, confidence spans and the low-confidence marker: the same `TextAssembler` as local
  generation, with each token's entropy estimated from the server's `top_logprobs`; the result
  ends the same way (GenerationStream._conclude), the text so far travelling with any error;
* token ids: a server streams text, so results carry none (`tokens` is None), only their count;
* cancellation: the response is closed between two streamed tokens, which a server sees as a
  disconnect and stops generating;
* time: the timeout (client.timeout) bounds the time without a token, whatever else the server
  sends meanwhile (SSE comments, events without choices);
* embeddings: `/v1/embeddings`; per-token vectors (llama_cpp.server's answer for models without
  pooling) are pooled here.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

import httpx
import numpy as np

from ..engine import Embedded, Engine, Model
from ..errors import A3BError, Cancelled, InvalidRequest, ModelUnloaded, PromptTooLong, RemoteProtocolError, \
    RemoteUnreachable, VisionUnavailable
from ..generation import TokenEvent
from ..stream import GenerationStream
from ..reasoning import NONE, THINK, ChannelAssembler
from ..options import LoadSpec, parse_speculative
from ..requests import ChatPrompt, GenerationRequest, Prompt, TokenPrompt, prompt_images, prompt_texts
from . import wire
from .client import DONE, KEEPALIVE, TIMEOUT_ENV, check_allowed, parse_ref, timeout
from .probe import RemoteWeights, probe

log = logging.getLogger("a3b.remote")

#: texts per /embeddings request: a cancel is seen between packs
EMBED_PACK = 8


class RemoteModel(Model):
    """A model behind an OpenAI-compatible server (what the store hands out for its URL)."""

    def __init__(self, weights: RemoteWeights, spec: LoadSpec):
        self.weights = weights
        self.info = weights.info
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

    @property
    def alive(self) -> bool:
        return not self._closing

    @property
    def supports_fim(self) -> bool:
        return bool(self.features.get("infill"))

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

    # -- tokens --------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """The server's token ids for `text`, from its tokenize endpoint (InvalidRequest without one)."""
        path = self.features.get("tokenize")
        if not path:
            raise InvalidRequest(f"The server at {self.client.ref.base} has no tokenize endpoint, so its token ids "
                                 "are not known here.")
        if path == "/tokenize":
            body = {"content": text, "add_special": add_bos, "parse_special": special}
        else:
            body = {"input": text}
        out = self.client.post(path, body, root=True)
        toks = out.get("tokens") if isinstance(out, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise RemoteProtocolError(f"The server at {self.client.ref.base} answered {path} without a list of "
                                      "token ids.")
        return toks

    def count_tokens(self, prompt: Prompt, *, exact: bool = True) -> int:
        """Tokens of `prompt`: counted by the server's tokenize endpoint when it has one (and `exact`),
        else estimated (wire.estimate_prompt). Either way only the prompt's texts are counted, plus
        an estimate of what a chat template adds per message: the server renders the template."""
        return self._count(prompt, exact)[0]

    def _count(self, prompt: Prompt, exact: bool) -> tuple[int, bool]:
        """(tokens, whether the count is exact)."""
        if isinstance(prompt, TokenPrompt):
            return len(prompt.tokens), True
        if exact and self.features.get("tokenize"):
            overhead = 0
            if isinstance(prompt, ChatPrompt):
                overhead = (wire.CHAT_TOKENS_PER_MESSAGE * len(prompt.messages)
                            + wire.IMAGE_TOKENS_ESTIMATE * len(prompt_images(prompt)))
            try:
                return len(self.tokenize("\n".join(t for t in prompt_texts(prompt) if t))) + overhead, not overhead
            except A3BError as e:
                log.debug("tokenize failed, estimating: %s", e)
        return wire.estimate_prompt(prompt), False

    # -- generation ------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest,
               on_token: Callable[[TokenEvent], None] | None = None) -> GenerationStream:
        request.validate()
        if prompt_images(request.prompt) and self.features.get("server") == "llama-server" \
                and not self.features.get("vision"):   # its /props says it has no projector
            raise VisionUnavailable(f"The model served at {self.client.ref.base} does not see images (the server "
                                    "reports no vision). Start llama-server with the model's projector (--mmproj "
                                    "FILE), or send text only.")
        route, root, body = wire.request_body(request, self.name, self.supports_fim)
        n_prompt, exact = self._count(request.prompt, True)
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
        threading.Thread(target=self._run, args=(stream, self.client.url(route, root), body, n_prompt), daemon=True,
                         name=f"a3b-remote-{stream.id}").start()
        return stream

    def _run(self, stream: GenerationStream, url: str, body: dict, n_prompt: int) -> None:
        req = stream.request
        # a server that splits reasoning off sends it as reasoning_content; one that does not
        # leaves <think> ... </think> in the content, which the splitter takes apart here
        asm = ChannelAssembler(THINK if isinstance(req.prompt, ChatPrompt) else NONE, req.stop, req.confidence,
                               n_indent=req.n_indent)
        n = 0
        t_first = t_last = None
        reason, error = "stop", None
        base = self.client.ref.base
        limit = timeout()
        try:
            with self.client.http.stream("POST", url, json=body) as r:
                self.client.raise_for(r)
                ended = False
                t_token = time.monotonic()
                for ev in self.client.events(r):
                    if stream.cancelled:
                        reason = "cancelled"
                        break
                    if ev is DONE:
                        ended = True
                        break
                    text, lp, finish = ("", None, None) if ev is KEEPALIVE else wire.delta(ev, base)
                    thought = "" if ev is KEEPALIVE else wire.reasoning_delta(ev, base)
                    now = time.monotonic()
                    if text or thought:
                        t_token = now
                        t_last = time.perf_counter()
                        t_first = t_first or t_last
                        n += 1
                        ent = wire.entropy_of(lp[1]) if lp and req.confidence.enabled else None
                        r = asm.add_reasoning(thought, ent if not text else None) if thought else ""
                        r2, out = asm.add(text.encode("utf-8", "surrogatepass"), ent) if text else ("", "")
                        if req.logprobs is not None and lp:
                            stream._emit(TokenEvent(out, None, ent, text, lp[0], lp[1][:req.logprobs],
                                                    reasoning=r + r2))
                        else:
                            stream._emit(TokenEvent(out, None, ent, reasoning=r + r2))
                        if self._at_limit(req, asm, n) and not asm.stopped:
                            reason = "length"
                    elif now - t_token > limit:
                        raise RemoteUnreachable(f"The server at {base} sent no token for {limit:g} s (only "
                                                f"keep-alive messages). Check that it is not overloaded; "
                                                f"{TIMEOUT_ENV} sets the limit in seconds.")
                    if finish:
                        reason = "length" if finish == "length" else "stop"
                        ended = True
                        break
                    if asm.stopped or self._at_limit(req, asm, n):
                        ended = True
                        break
                if not ended and not stream.cancelled:
                    raise RemoteProtocolError(
                        f"The server at {base} ended its answer without finishing it, after {n} tokens. Check the "
                        "server's log: llama_cpp.server does this when the prompt is longer than its context.")
        except A3BError as e:
            reason, error = "error", e
        except (httpx.HTTPError, OSError) as e:
            reason, error = "error", self.client.unreachable(e)
        except BaseException as e:
            log.exception("remote request failed")
            reason, error = "error", RemoteProtocolError(f"{base}: {type(e).__name__}: {e}")
        if stream.cancelled:   # also when closing the connection made the read fail
            reason, error = "cancelled", None
        self.stats[f"finished_{reason}"] += 1
        self.stats["generated_tokens"] += n
        self.last_used = time.monotonic()
        with self._lock:
            self._running.discard(stream)
        sp = req.sampling
        stream._conclude(asm, reason, error, model=self.name, tokens=None, n_tokens=n, n_prompt=n_prompt, n_cached=0,
                         seed=sp.seed if sp.seed is not None else -1, t_first=t_first, t_last=t_last)

    @staticmethod
    def _at_limit(req: GenerationRequest, asm: ChannelAssembler, n: int) -> bool:
        """max_tokens counts the answer, max_total_tokens everything the server streamed."""
        return asm.n_answer >= req.max_tokens or (req.max_total_tokens is not None and n >= req.max_total_tokens)

    # -- embeddings ----------------------------------------------------------------------------
    def embed(self, texts: Sequence[str], *, pooling: str = "mean", normalize: bool = True, priority: int = 0,
              cancelled: Callable[[], bool] | None = None) -> Embedded:
        base = self.client.ref.base
        rows: list[np.ndarray] = []
        first = n_tokens = 0
        while first < len(texts):   # small packs: a cancel is seen between them
            if cancelled is not None and cancelled():
                raise Cancelled("Embedding cancelled.")
            if self._closing:
                raise ModelUnloaded(f"{self.name} was unloaded ({self._closing}) before the embedding finished.")
            pack = list(texts[first:first + (1 if self.features.get("embed_one_by_one") else EMBED_PACK)])
            answer = self.client.post("/embeddings", {"input": pack, "model": self.name})
            vecs = wire.embedding_rows(answer, len(pack), base)
            if len(vecs) > 1 and any(v.ndim == 2 for v in vecs):
                # per-token vectors for several texts: llama_cpp.server (0.3.36) slices them wrongly
                # for all but the first text, so such a server gets one text per request
                log.info("%s answers per-token embeddings; embedding one text per request", base)
                self.features["embed_one_by_one"] = True
                continue
            rows.extend(wire.pool(v, pooling) for v in vecs)
            n_tokens += wire.embedded_tokens(answer, pack[:len(vecs)])
            first += len(vecs)
        self.stats["embedded_texts"] += len(texts)
        self.last_used = time.monotonic()
        out = wire.stack(rows, base)
        if normalize:
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            out = out / np.where(norms > 0, norms, 1.0)
        return Embedded(out, n_tokens)


class RemoteEngine(Engine):
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

    def open_model(self, weights: RemoteWeights, spec: LoadSpec, models: Callable[[LoadSpec], Model]) -> RemoteModel:
        """The server drafts by itself, if at all: drafts made here (a draft model, MTP layers) are refused."""
        mode = parse_speculative(spec.speculative)[0]
        if mode in ("draft", "mtp"):
            raise InvalidRequest(f"{weights.info.name} runs in another engine; speculative={mode} drafts for a model "
                                 "run here. Use speculative=off.")
        return RemoteModel(weights, spec)
