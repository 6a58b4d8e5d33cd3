"""Ollama's API on `a3b serve`, beside the OpenAI one (same port, same token, Host and Origin rules):
`/api/chat` and `/api/generate` (NDJSON lines, or one object with "stream": false), `/api/embed` and
the older `/api/embeddings`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`, and `GET /`.

Tools that speak only Ollama (comfyui-ollama, Open WebUI's Ollama connection, Continue, the `ollama`
Python client) then share the weights this process holds. Request fields are read by
ollama_protocol.py; generation goes through the same runtime, scheduler and bridge as the OpenAI
endpoints, so a client that leaves cancels its generation between two tokens. Errors have Ollama's
shape ({"error": "..."}; a model not served is a 404). `keep_alive` sets when an idle model is
unloaded from the store (KeepAlive below).
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
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..runtime import PRIORITY_BATCH
from ..runtime.errors import A3BError, Cancelled, InvalidRequest, ModelNotFound, PromptTooLong
from ..runtime.generation import TokenEvent
from ..runtime.options import LoadSpec
from ..runtime.requests import ChatPrompt, InfillPrompt, TextPrompt
from . import bridge, routed
from .disconnect import on_disconnect
from . import ollama_protocol as P
from .fields import read_json
from .tools import ToolCallStream, split_answer

log = logging.getLogger("a3b.serve")


class KeepAlive:
    """Ollama's keep_alive over the model store: after a request, a model stays loaded for that long
    once idle, then is unloaded (0: at once; negative: until the store itself evicts it). A model
    still busy when its time comes is looked at again a second later. Runs on the server's loop."""

    def __init__(self, rt):
        self.rt = rt
        self.timers: dict[LoadSpec, asyncio.TimerHandle] = {}
        #: when each model will be unloaded (time.time()); None: kept
        self.expires: dict[LoadSpec, float | None] = {}

    def after(self, spec: LoadSpec, seconds: float | None) -> None:
        if seconds is None:
            return
        old = self.timers.pop(spec, None)
        if old is not None:
            old.cancel()
        if seconds < 0:
            self.expires[spec] = None
            return
        self.expires[spec] = time.time() + seconds
        self.timers[spec] = asyncio.get_running_loop().call_later(seconds, self._expire, spec)

    def _expire(self, spec: LoadSpec) -> None:
        self.timers.pop(spec, None)
        loop = asyncio.get_running_loop()
        m = self.rt.loaded(spec)
        if m is None:
            self.expires.pop(spec, None)
            return
        if m.busy():
            self.timers[spec] = loop.call_later(1.0, self._expire, spec)
            return
        self.expires.pop(spec, None)
        log.info("keep_alive over: unloading %s", spec.path)
        loop.run_in_executor(None, self.rt.unload, spec)


def ollama_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(P.error_body(message), status_code=status)


class OllamaApi:
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
            spec, d = await routed.decide(self.cfg, body)
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
            vecs = self.rt.embed(cut, model=spec, normalize=not legacy, cancelled=gone.is_set)
            return vecs, sum(len(self.rt.tokenize(t, model=spec)) for t in cut)

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

    # -- generation -----------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        body = await read_json(request)
        name, spec, decision = await self.resolve(body)
        tools = P.tools_of(body)
        if body.get("messages") == []:
            return await self._load_only(body, name, spec, "chat")
        opts, variables = P.think_of(body)
        schema = P.format_of(body)
        if schema is not None and tools:
            raise InvalidRequest("tools and format together are not supported: the grammar would keep the model "
                                 "from calling a tool. Give one of them.")
        prompt = ChatPrompt(tuple(P.messages_of(body)), variables=variables, tools=tools)
        return await self._generate(request, body, name, spec, decision, prompt, "chat",
                                    {**opts, **({"json_schema": schema} if schema else {})}, bool(tools))

    async def generate(self, request: Request) -> Response:
        body = await read_json(request)
        name, spec, decision = await self.resolve(body)
        for key in ("template", "context"):
            if body.get(key):
                raise InvalidRequest(f"{key} is not supported by this server: "
                                     + ("the model's own chat template is used (or raw: true)." if key == "template"
                                        else "send the conversation as messages to /api/chat instead."))
        prompt_text = body.get("prompt") or ""
        if not isinstance(prompt_text, str):
            raise InvalidRequest("prompt must be a string.")
        images = P.images_of(body.get("images"), "images")
        if not prompt_text and not images and body.get("suffix") is None:
            return await self._load_only(body, name, spec, "generate")
        opts, variables = P.think_of(body)
        schema = P.format_of(body)
        system = body.get("system")
        if system is not None and not isinstance(system, str):
            raise InvalidRequest("system must be a string.")
        if body.get("suffix") is not None:
            if not isinstance(body["suffix"], str) or images or body.get("raw") or system or opts or schema:
                raise InvalidRequest("suffix (fill in the middle) takes a text prompt alone: no images, raw, "
                                     "system, think or format beside it.")
            prompt: Any = InfillPrompt(prompt_text, body["suffix"])
        elif body.get("raw"):
            if images or system or opts:
                raise InvalidRequest("raw: true sends the prompt as it is: images, system and think need the "
                                     "chat template (leave raw out).")
            prompt = TextPrompt(prompt_text)
        else:
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": (*images, prompt_text) if images else prompt_text}]
            prompt = ChatPrompt(tuple(msgs), variables=variables)
        return await self._generate(request, body, name, spec, decision, prompt, "generate",
                                    {**opts, **({"json_schema": schema} if schema else {})}, False)

    async def _load_only(self, body: dict, name: str, spec: LoadSpec, kind: str) -> Response:
        """Ollama's way to load (or, with keep_alive 0, unload) a model: a request with nothing to answer."""
        t0 = time.perf_counter()
        keep = P.keep_alive_of(body)
        await asyncio.get_running_loop().run_in_executor(None, self.rt.load, spec)
        self.keep.after(spec, keep)
        reason = "unload" if keep == 0 else "load"
        out: dict[str, Any] = {"model": name, "created_at": P.now(), "done": True, "done_reason": reason,
                               **P.timings(None, time.perf_counter() - t0, time.perf_counter() - t0)}
        out.update({"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""})
        return JSONResponse(out)

    async def _generate(self, request: Request, body: dict, name: str, spec: LoadSpec, decision: Any, prompt: Any,
                        kind: str, extra: dict, tools: bool) -> Response:
        t0 = time.perf_counter()
        keep = P.keep_alive_of(body)
        loop = asyncio.get_running_loop()
        m = await loop.run_in_executor(None, self.rt.load, spec)
        load_s = time.perf_counter() - t0
        o = P.options_of(body, spec.n_ctx, name)
        max_tokens = o["max_tokens"]
        if o["num_ctx"] is not None:   # a smaller context than the served one bounds prompt and answer
            n = await loop.run_in_executor(None, lambda: m.count_tokens(prompt))
            if n >= o["num_ctx"]:
                raise PromptTooLong(f"The prompt takes {n} tokens, options.num_ctx is {o['num_ctx']}: give a larger "
                                    "num_ctx or a shorter prompt.")
            max_tokens = min(max_tokens, o["num_ctx"] - n)
        abandoned = threading.Event()   # set when the client leaves while its format's grammar compiles
        stream, q = await bridge.start(lambda on_token: self.rt.submit(
            prompt, model=spec, on_token=on_token, max_tokens=max_tokens, sampling=o["sampling"], stop=o["stop"],
            priority=PRIORITY_BATCH, abandoned=abandoned, **extra), request, abandoned)
        headers = routed.header(decision) if decision is not None else {}
        a3b = {"a3b": {"route": decision.as_dict()}} if decision is not None else {}
        if body.get("stream", True):
            return StreamingResponse(self._lines(request, stream, q, name, kind, tools, t0, load_s, spec, keep, a3b),
                                     media_type="application/x-ndjson", headers=headers)
        async with bridge.watched(request, stream, None, self.cfg.stats):
            while (q.items.popleft() if q.items else await q.get()) is not None:
                pass
        res = bridge.result(stream)
        self.keep.after(spec, keep)
        out: dict[str, Any] = {"model": name, "created_at": P.now()}
        if kind == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": res.text}
            if tools:
                content, calls, _ = split_answer(res.text)
                if calls:
                    msg.update(content=content.strip(), tool_calls=[P.ollama_call(c) for c in calls])
            if res.reasoning:
                msg["thinking"] = res.reasoning
            out["message"] = msg
        else:
            out["response"] = res.text
            if res.reasoning:
                out["thinking"] = res.reasoning
        out.update(done=True, done_reason=P.done_reason(res), **P.timings(res, time.perf_counter() - t0, load_s),
                   **a3b)
        return JSONResponse(out, headers=headers)

    async def _lines(self, request: Request, stream, q: bridge.Inbox, name: str, kind: str, tools: bool, t0: float,
                     load_s: float, spec: LoadSpec, keep: float | None, a3b: dict):
        calls = ToolCallStream() if tools else None

        def piece(text: str = "", thinking: str = "", tool_calls: list | None = None) -> bytes:
            out: dict[str, Any] = {"model": name, "created_at": P.now()}
            if kind == "chat":
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                if thinking:
                    msg["thinking"] = thinking
                if tool_calls:
                    msg["tool_calls"] = tool_calls
                out["message"] = msg
            else:
                out["response"] = text
                if thinking:
                    out["thinking"] = thinking
            out["done"] = False
            return P.line(out)

        def pieces(ev: TokenEvent) -> bytes:
            out = piece(thinking=ev.reasoning) if ev.reasoning else b""
            if calls is None:
                return out + (piece(ev.text) if ev.text else b"")
            return out + shaped(calls.feed(ev.text))

        def shaped(parts: list) -> bytes:
            return b"".join(piece(p) if k == "content" else piece(tool_calls=[P.ollama_call(p)]) for k, p in parts
                            if k != "content" or p)

        async with bridge.watched(request, stream, None, self.cfg.stats):
            ended = False
            while not ended:
                await q.wait()
                out = b""
                while q.items:   # everything ready goes out in one write
                    ev = q.items.popleft()
                    if ev is None:
                        ended = True
                        break
                    out += pieces(ev)
                if out:
                    yield out
            try:
                res = bridge.result(stream)
            except A3BError as e:
                self.cfg.stats["errors"] += 1
                yield P.line(P.error_body(str(e)))
                return
            if calls is not None:
                tail = shaped(calls.flush())
                if tail:
                    yield tail
            final: dict[str, Any] = {"model": name, "created_at": P.now()}
            final.update({"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""})
            final.update(done=True, done_reason=P.done_reason(res),
                         **P.timings(res, time.perf_counter() - t0, load_s), **a3b)
            yield P.line(final)
        self.keep.after(spec, keep)

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
