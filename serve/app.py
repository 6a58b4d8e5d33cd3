"""The OpenAI-compatible HTTP API over the runtime, as a Starlette (ASGI) application.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions` (both streaming
as server-sent events), `POST /v1/embeddings`, llama-server's `POST /infill`, `POST /tokenize`,
`GET /props` and `GET /health`. Every request goes through the process's one runtime, so the
weights that ComfyUI or the language server hold serve these clients too, in the same scheduler:
`/infill` is interactive (an editor waits for it), the rest batch.

The host process must survive any client: every body is checked before it reaches the runtime, a
runtime error becomes an OpenAI-shaped error answer, and a client that goes away cancels its
generation between two tokens.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..runtime import PRIORITY_BATCH, PRIORITY_INTERACTIVE, get_runtime
from ..runtime.errors import A3BError, Cancelled, InvalidRequest, ModelNotFound, PromptTooLong
from ..runtime.generation import TokenEvent
from ..runtime.netguard import host_header_ok, origin_ok, token_ok
from ..runtime.options import LoadSpec
from . import answers, bridge, routed
from .body import read_json
from .chatout import ChatOutput
from .disconnect import on_disconnect
from .ollama_api import ollama_routes
from .config import ServeConfig
from .protocol import (ChatRequest, CompletionRequest, InfillRequest, parse_chat, parse_completion, parse_embeddings,
                       parse_infill, parse_tokenize)

log = logging.getLogger("a3b.serve")

# -- errors ------------------------------------------------------------------------------------------
#: Longest error message sent back: messages quote what the client sent, which may be megabytes.
MAX_MESSAGE = 2000


def shown(value: Any, limit: int = 100) -> str:
    """A value the client sent, quoted for a message and cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def error(status: int, message: str, code: str = "invalid_request_error", kind: str = "invalid_request_error",
          headers: dict[str, str] | None = None) -> JSONResponse:
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "..."
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=status,
                        headers=headers)


def a3b_error(e: A3BError) -> JSONResponse:
    if isinstance(e, PromptTooLong):
        return error(400, str(e), "context_length_exceeded")
    if isinstance(e, ModelNotFound):
        return error(404, str(e), "model_not_found")
    if isinstance(e, InvalidRequest):
        return error(400, str(e), e.code)
    return error(500 if not isinstance(e, Cancelled) else 499, str(e), e.code, "server_error")


class Guard:
    """Bearer token, Host and Origin checks in front of every endpoint (plain ASGI, so streaming
    responses pass through untouched)."""

    def __init__(self, app, cfg: ServeConfig):
        self.app, self.cfg = app, cfg

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self.refusal(scope, headers)
        if refusal is not None:
            return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)

    def refusal(self, scope, headers: dict[str, str]) -> Response | None:
        cfg = self.cfg
        if cfg.loopback:
            host = headers.get("host", "")
            if not host_header_ok(host):
                return error(403, f"Host {host[:100]!r} refused: this server listens on the loopback only.",
                             "host_not_allowed")
        origin = headers.get("origin")
        if not origin_ok(origin, cfg.origins):
            return error(403, f"Origin {origin[:100]!r} refused: browser pages may call this server only when it is "
                              "started with --allow-origin for them.", "origin_not_allowed")
        if scope["method"] == "OPTIONS" and origin is not None:
            return None   # a CORS preflight of an allowed Origin: it carries no credentials
        if cfg.token:
            auth = headers.get("authorization", "")
            scheme, _, given = auth.partition(" ")
            if scheme.lower() != "bearer" or not token_ok(cfg.token, given.strip()):
                return error(401, "A valid bearer token is required (Authorization: Bearer TOKEN).",
                             "invalid_api_key", "authentication_error", {"WWW-Authenticate": "Bearer"})
        return None


# -- the application --------------------------------------------------------------------------------
class Api:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.rt = get_runtime()

    def spec_for(self, name: Any) -> LoadSpec:
        """The served model a request names (None or "": the one this server was started with)."""
        if isinstance(name, str) and name in self.cfg.others:
            return self.cfg.others[name]
        if name in (None, "", self.cfg.model_id, self.cfg.spec.path, Path(self.cfg.spec.path).name):
            return self.cfg.spec
        raise ModelNotFound(f"This server does not serve {shown(name)}; it serves {self.cfg.model_id!r} "
                            "(GET /v1/models).")

    # -- plain endpoints --------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        spec = self.cfg.spec
        loaded = self.rt.loaded(spec)   # whether it sees images is known once it is loaded
        vision = bool(loaded is not None and loaded.features.get("vision"))
        return JSONResponse({"object": "list", "data": [{
            "id": self.cfg.model_id, "object": "model", "created": int(self.rt.created), "owned_by": "a3b",
            "vision": vision, "meta": {"n_ctx": spec.n_ctx, "n_parallel": spec.n_parallel, "vision": vision}}] + [{
            "id": name, "object": "model", "created": int(self.rt.created), "owned_by": "a3b",
            "meta": {"n_ctx": o.n_ctx, "n_parallel": o.n_parallel}} for name, o in self.cfg.others.items()]})

    async def props(self, request: Request) -> Response:
        m = await asyncio.get_running_loop().run_in_executor(None, self.rt.load, self.cfg.spec)
        return JSONResponse({"default_generation_settings": {"n_ctx": m.n_ctx_seq},
                             "total_slots": self.cfg.spec.n_parallel,
                             "chat_template": m.info.chat_template or "", "model_alias": self.cfg.model_id,
                             "modalities": {"vision": bool(m.features.get("vision")), "audio": False},
                             "a3b": True, "a3b_stats": dict(m.stats)})

    async def tokenize(self, request: Request) -> Response:
        req = parse_tokenize(await read_json(request))
        toks = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.rt.tokenize(req.content, model=self.spec_for(req.model), add_bos=req.add_special,
                                           special=req.add_special))
        return JSONResponse({"tokens": toks})

    async def embeddings(self, request: Request) -> Response:
        req = parse_embeddings(await read_json(request))
        spec = self.spec_for(req.model)
        texts = list(req.input)
        gone = threading.Event()

        def run():
            out = self.rt.embed_counted(texts, model=spec, priority=PRIORITY_BATCH, cancelled=gone.is_set)
            return out.vectors, out.n_tokens

        def left() -> None:   # the work ends between two packs, with Cancelled
            self.cfg.stats["disconnects"] += 1
            gone.set()

        task = asyncio.get_running_loop().run_in_executor(None, run)
        async with on_disconnect(request, left):
            vecs, n_tok = await task
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype(np.float32).tobytes()).decode()
                 if req.encoding_format == "base64" else [float(x) for x in v]} for i, v in enumerate(vecs)]
        return JSONResponse({"object": "list", "data": data, "model": self.cfg.model_id,
                             "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}})

    async def chat(self, request: Request) -> Response:
        req = parse_chat(await read_json(request))
        return await self._generate(request, req, "chat", out=ChatOutput(bool(req.tools)))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion(await read_json(request)), "text")

    async def infill(self, request: Request) -> Response:
        """llama-server's /infill: interactive (an editor waits for it), with its own time limit."""
        req = parse_infill(await read_json(request))
        return await self._generate(request, req, "infill", PRIORITY_INTERACTIVE, req.deadline_s)

    async def _generate(self, request: Request, req: ChatRequest | CompletionRequest | InfillRequest, kind: str,
                        priority: int = PRIORITY_BATCH, deadline_s: float | None = None,
                        out: ChatOutput | None = None) -> Response:
        gen, decision = req.gen, None
        if kind != "infill" and routed.is_route(self.cfg, gen.model):
            spec, decision = await routed.decide(self.cfg, gen.route_text)
            mid = gen.model or self.cfg.route_name
        else:
            spec = self.spec_for(gen.model)
            mid = gen.model if spec is not self.cfg.spec else self.cfg.model_id
        if decision is not None and out is not None:
            out.route = decision.as_dict()
        # set when the client leaves before the request is queued (its grammar may still be compiling)
        abandoned = threading.Event()
        settings = req.settings()
        stream, q = await bridge.start(lambda on_token: self.rt.submit(
            req.prompt, model=spec, on_token=on_token, priority=priority, abandoned=abandoned, **settings),
            request, abandoned)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        if gen.stream:
            sse = bridge.sse(request, stream, q, kind, rid, gen.include_usage, deadline_s, out, mid, self.cfg.stats)
            return StreamingResponse(sse, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              **(routed.header(decision) if decision else {})})
        events: list[TokenEvent] = []
        async with bridge.watched(request, stream, deadline_s, self.cfg.stats):
            while (ev := q.items.popleft() if q.items else await q.get()) is not None:
                events.append(ev)
        res = bridge.result(stream)
        answer = answers.final(kind, mid, rid, res, events, out)
        if decision is not None:
            answer["a3b"]["route"] = decision.as_dict()
        return JSONResponse(answer, headers=routed.header(decision) if decision else None)


def _client(request: Request) -> str:
    c = request.client
    return f"{c.host}:{c.port}" if c else "a client"


def create_app(cfg: ServeConfig) -> Any:
    """The ASGI application: the routes, CORS for the allowed Origins, and the Guard in front."""
    api = Api(cfg)

    def wrap(fn):
        async def endpoint(request: Request) -> Response:
            cfg.stats["requests"] += 1
            try:
                return await fn(request)
            except A3BError as e:
                cfg.stats["errors"] += 1
                return a3b_error(e)
            except ClientDisconnect:   # it left while sending its body: nobody reads an answer
                cfg.stats["disconnects"] += 1
                log.info("%s left while sending its request to %s", _client(request), request.url.path)
                return Response(status_code=499)
            except (ValueError, TypeError, KeyError) as e:
                cfg.stats["errors"] += 1
                log.warning("bad request to %s: %s", request.url.path, e)
                return error(400, f"Bad request: {type(e).__name__}: {e}")
            except Exception as e:
                cfg.stats["errors"] += 1
                log.exception("request to %s failed", request.url.path)
                return error(500, f"Internal error: {type(e).__name__}: {e}", "internal_error", "server_error")
        return endpoint

    routes = [
        Route("/health", wrap(api.health), methods=["GET"]),
        Route("/v1/health", wrap(api.health), methods=["GET"]),
        Route("/v1/models", wrap(api.models), methods=["GET"]),
        Route("/props", wrap(api.props), methods=["GET"]),
        Route("/tokenize", wrap(api.tokenize), methods=["POST"]),
        Route("/v1/chat/completions", wrap(api.chat), methods=["POST"]),
        Route("/v1/completions", wrap(api.completions), methods=["POST"]),
        Route("/v1/embeddings", wrap(api.embeddings), methods=["POST"]),
        Route("/infill", wrap(api.infill), methods=["POST"]),
        Route("/v1/infill", wrap(api.infill), methods=["POST"]),
    ]
    routes += ollama_routes(api)   # Ollama's API on the same port, behind the same Guard
    app = Starlette(routes=routes)
    app = CORSMiddleware(app, allow_origins=list(cfg.origins), allow_methods=["GET", "POST", "OPTIONS"],
                         allow_headers=["Authorization", "Content-Type"])
    return Guard(app, cfg)
