"""Ollama's generation endpoints on `a3b serve`: `/api/chat` and `/api/generate`, as NDJSON lines
or one object with "stream": false, through the same runtime, scheduler and bridge as the OpenAI
endpoints (a client that leaves cancels its generation between two tokens). A request with nothing
to answer loads the model (or, with keep_alive 0, unloads it), as Ollama does.

`Generating` is a part of ollama_api.OllamaApi: it uses the API's `cfg`, `rt`, `keep` (KeepAlive)
and `resolve` (the model a request names).
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..runtime import PRIORITY_BATCH
from ..runtime.errors import A3BError, InvalidRequest, PromptTooLong
from ..runtime.generation import TokenEvent
from ..runtime.options import LoadSpec
from ..runtime.requests import ChatPrompt, InfillPrompt, TextPrompt
from . import bridge, routed
from . import ollama_protocol as P
from .body import read_json
from .tools import ToolCallStream, split_answer


class Generating:
    """/api/chat and /api/generate."""

    cfg: Any
    rt: Any
    keep: Any

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
        route = {"route": decision.as_dict()} if decision is not None else {}
        if body.get("stream", True):
            return StreamingResponse(self._lines(request, stream, q, name, kind, tools, t0, load_s, spec, keep, route),
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
                   **P.a3b_block(res, route))
        return JSONResponse(out, headers=headers)

    async def _lines(self, request: Request, stream, q: bridge.Inbox, name: str, kind: str, tools: bool, t0: float,
                     load_s: float, spec: LoadSpec, keep: float | None, route: dict):
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
                         **P.timings(res, time.perf_counter() - t0, load_s), **P.a3b_block(res, route))
            yield P.line(final)
        self.keep.after(spec, keep)


__all__ = ["Generating"]
