"""Ollama's API on `a3b serve`, beside the OpenAI one (same port, same token, Host and Origin rules):
`/api/chat` and `/api/generate` (NDJSON lines, or one object with "stream": false), `/api/embed` and
the older `/api/embeddings`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`, and `GET /`.

Tools that speak only Ollama (comfyui-ollama, Open WebUI's Ollama connection, Continue, the `ollama`
Python client) then share the weights this process holds. Request fields are read by
ollama_protocol.py; generation (ollama_generate.py) goes through the same runtime, scheduler and
bridge as the OpenAI endpoints, so a client that leaves cancels its generation between two tokens.
Errors have Ollama's shape ({"error": "..."}; a model not served is a 404). `keep_alive` sets when an
idle model is unloaded from the store (ollama_keepalive.py). This module: the model names, the
listing and embedding endpoints, the error shape and the routes.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..runtime.errors import A3BError, Cancelled, InvalidRequest, ModelNotFound, PromptTooLong
from ..runtime.options import LoadSpec
from . import routed
from .disconnect import on_disconnect
from . import ollama_protocol as P
from .body import read_json
from .ollama_generate import Generating
from .ollama_keepalive import KeepAlive

log = logging.getLogger("a3b.serve")


def ollama_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(P.error_body(message), status_code=status)


class OllamaApi(Generating):
    """Ollama's endpoints over the app's Api (its config and runtime); generation in ollama_generate.py."""

    def __init__(self, api):
        self.api, self.cfg, self.rt = api, api.cfg, api.rt
        self.keep = KeepAlive(self.rt)

    # -- names ----------------------------------------------------------------------------------
    def served(self) -> dict[str, LoadSpec]:
        return {self.cfg.model_id: self.cfg.spec, **self.cfg.others}

    def spec_of(self, name: str) -> LoadSpec:
        served = self.served()
        plain = P.bare(name)
        if plain in served:
            return served[plain]
        for spec in served.values():
            if name in (spec.path, Path(spec.path).name):
                return spec
        raise ModelNotFound(f"model '{name[:200]}' not found")

    async def resolve(self, body: dict) -> tuple[str, LoadSpec, Any]:
        """(the name to answer with, the spec, the route decision or None)."""
        name = P.model_of(body, required=getattr(self.cfg, "router", None) is None)
        if routed.is_route(self.cfg, name):
            spec, d = await routed.decide(self.cfg, routed.route_text(body))
            return name or self.cfg.route_name, spec, d
        return name, self.spec_of(name), None

    # -- plain endpoints ------------------------------------------------------------------------
    async def root(self, request: Request) -> Response:
        return PlainTextResponse("Ollama is running")

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": P.API_VERSION})

    def _details(self, spec: LoadSpec) -> dict:
        m = self.rt.loaded(spec)
        info = m.info if m is not None else None
        return {"parent_model": "", "format": "gguf", "family": info.architecture if info else "",
                "families": [info.architecture] if info else None, "parameter_size": "",
                "quantization_level": (info.file_type or "") if info else ""}

    def _entry(self, name: str, spec: LoadSpec) -> dict:
        try:
            st = os.stat(spec.path)
            size, mtime = st.st_size, st.st_mtime
        except OSError:
            size, mtime = 0, time.time()
        digest = hashlib.sha256(f"{spec.path}:{size}:{mtime}".encode()).hexdigest()
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(mtime))
        return {"name": P.tagged(name), "model": P.tagged(name), "modified_at": when, "size": size,
                "digest": digest, "details": self._details(spec)}

    async def tags(self, request: Request) -> Response:
        models = [self._entry(n, s) for n, s in self.served().items()]
        if getattr(self.cfg, "router", None) is not None:
            entry = self._entry(self.cfg.route_name, self.cfg.spec)
            entry["details"] = {**entry["details"], "family": "router",
                                "routes": {r: P.tagged(n) for r, n in self.cfg.router.names.items()}}
            models.append(entry)
        return JSONResponse({"models": models})

    async def show(self, request: Request) -> Response:
        body = await read_json(request)
        name = P.model_of(body)
        spec = self.cfg.spec if routed.is_route(self.cfg, name) and name else self.spec_of(name)
        m = await asyncio.get_running_loop().run_in_executor(None, self.rt.load, spec)
        info = m.info
        template = info.chat_template or ""
        caps = ["completion"] + (["tools"] if "tools" in template else []) + (
            ["thinking"] if "think" in template else []) + (["vision"] if m.features.get("vision") else []) + (
            ["insert"] if m.supports_fim else [])
        arch = info.architecture
        return JSONResponse({
            "license": "", "modelfile": f"FROM {spec.path}\n", "parameters": f"num_ctx {spec.n_ctx}",
            "template": template, "details": self._details(spec), "capabilities": caps,
            "model_info": {"general.architecture": arch, "general.file_type": info.file_type,
                           f"{arch}.context_length": spec.n_ctx, f"{arch}.embedding_length": info.n_embd,
                           f"{arch}.block_count": info.n_layer, "general.basename": info.name},
            "modified_at": self._entry(name, spec)["modified_at"]})

    async def ps(self, request: Request) -> Response:
        out = []
        for name, spec in self.served().items():
            m = self.rt.loaded(spec)
            if m is None:
                continue
            e = self.rt.store.entry(spec)
            size = m.info.size_bytes + (e.est_bytes if e is not None else 0)
            exp = self.keep.expires.get(spec)
            until = exp if exp is not None else time.time() + 10 * 365 * 86400
            out.append({**self._entry(name, spec), "size": size,
                        "size_vram": size if m.info.n_gpu_layers else 0, "context_length": spec.n_ctx,
                        "expires_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(until))})
        return JSONResponse({"models": out})

    # -- embeddings -----------------------------------------------------------------------------
    async def embed(self, request: Request) -> Response:
        return await self._embed(request, legacy=False)

    async def embeddings(self, request: Request) -> Response:
        return await self._embed(request, legacy=True)

    async def _embed(self, request: Request, legacy: bool) -> Response:
        t0 = time.perf_counter()
        body = await read_json(request)
        name = P.model_of(body)
        spec = self.cfg.spec if routed.is_route(self.cfg, name) else self.spec_of(name)
        texts = body.get("prompt") if legacy else body.get("input")
        if legacy and not isinstance(texts, str):
            raise InvalidRequest("prompt must be a string (the text to embed).")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidRequest("input must be a string or a non-empty list of strings.")
        if len(texts) > 2048:
            raise InvalidRequest(f"At most 2048 texts per request, got {len(texts)}.")
        truncate = body.get("truncate", True)
        if not isinstance(truncate, bool):
            raise InvalidRequest("truncate must be true or false.")
        P.options_of(body, spec.n_ctx, name)   # checked like a generation's: nothing unknown passes
        keep = P.keep_alive_of(body)
        loop = asyncio.get_running_loop()
        t_load = time.perf_counter()
        m = await loop.run_in_executor(None, self.rt.load, spec)
        load_s = time.perf_counter() - t_load
        dims = body.get("dimensions")
        if dims is not None and dims != m.info.n_embd:
            raise InvalidRequest(f"dimensions={str(dims)[:20]}: {name} gives vectors of {m.info.n_embd} dimensions "
                                 "only; leave dimensions out.")
        gone = threading.Event()

        def run():
            cut = [self._cut(t, spec) if truncate else t for t in texts]
            out = self.rt.embed_counted(cut, model=spec, normalize=not legacy, cancelled=gone.is_set)
            return out.vectors, out.n_tokens

        task = loop.run_in_executor(None, run)
        async with on_disconnect(request, gone.set):
            vecs, n_tok = await task
        self.keep.after(spec, keep)
        if legacy:
            return JSONResponse({"embedding": [float(x) for x in vecs[0]]})
        return JSONResponse({"model": name, "embeddings": [[float(x) for x in v] for v in vecs],
                             **P.timings(None, time.perf_counter() - t0, load_s), "prompt_eval_count": n_tok})

    def _cut(self, text: str, spec: LoadSpec) -> str:
        """`text` cut to the tokens the embedding context takes (Ollama's truncate)."""
        limit = spec.embed_n_ctx
        for _ in range(8):
            n = len(self.rt.tokenize(text, model=spec))
            if n <= limit:
                return text
            text = text[: max(1, int(len(text) * limit / n * 0.95))]
        return text

    # -- what this server does not do -------------------------------------------------------------
    async def unsupported(self, request: Request) -> Response:
        return ollama_error(501, f"{request.url.path} is not supported: this server serves the models it was "
                                 "started with (a3b serve MODEL); it pulls, creates, copies and deletes none.")


def wrapped(cfg, fn):
    """An endpoint answering errors in Ollama's shape."""
    async def endpoint(request: Request) -> Response:
        cfg.stats["requests"] += 1
        try:
            return await fn(request)
        except ModelNotFound as e:
            cfg.stats["errors"] += 1
            return ollama_error(404, str(e))
        except Cancelled as e:
            return ollama_error(499, str(e))
        except A3BError as e:
            cfg.stats["errors"] += 1
            return ollama_error(400 if isinstance(e, (InvalidRequest, PromptTooLong)) else 500, str(e))
        except ClientDisconnect:
            cfg.stats["disconnects"] += 1
            return Response(status_code=499)
        except (ValueError, TypeError, KeyError) as e:
            cfg.stats["errors"] += 1
            log.warning("bad request to %s: %s", request.url.path, e)
            return ollama_error(400, f"Bad request: {type(e).__name__}: {e}")
        except Exception as e:
            cfg.stats["errors"] += 1
            log.exception("request to %s failed", request.url.path)
            return ollama_error(500, f"Internal error: {type(e).__name__}: {e}")
    return endpoint


def ollama_routes(api) -> list[Route]:
    """The Ollama endpoints over the app's Api (its config and runtime)."""
    o = OllamaApi(api)

    def r(path: str, fn, *methods: str) -> Route:
        return Route(path, wrapped(api.cfg, fn), methods=list(methods))

    return [r("/", o.root, "GET", "HEAD"), r("/api/version", o.version, "GET"), r("/api/tags", o.tags, "GET"),
            r("/api/ps", o.ps, "GET"), r("/api/show", o.show, "POST"), r("/api/chat", o.chat, "POST"),
            r("/api/generate", o.generate, "POST"), r("/api/embed", o.embed, "POST"),
            r("/api/embeddings", o.embeddings, "POST"),
            *(r(f"/api/{p}", o.unsupported, "POST", "DELETE") for p in ("pull", "push", "create", "copy", "delete"))]


__all__ = ["KeepAlive", "OllamaApi", "ollama_routes"]
