"""Which model a request names: a served model's id, or the route table's name (runtime/routing.py),
whose router picks the model from the request's text. Shared by the OpenAI and Ollama endpoints.
"""
from __future__ import annotations

import asyncio
from typing import Any

from ..runtime.errors import InvalidRequest
from ..runtime.options import LoadSpec
from ..runtime.routing import Decision
from .config import ServeConfig
from .protocol.common import MAX_ROUTED_CHARS, route_text

def is_route(cfg: ServeConfig, name: Any) -> bool:
    """Whether `name` names the route table (a request naming no model is routed when there is one)."""
    if cfg.router is None:
        return False
    return name in (None, "", cfg.route_name) or (isinstance(name, str) and name.split(":")[0] == cfg.route_name)


async def decide(cfg: ServeConfig, text: str) -> tuple[LoadSpec, Decision]:
    """The routed model of a request to the route table, by its text (protocol.common.route_text),
    decided off the event loop (tokenizing and embedding are not the loop's work)."""
    d = await asyncio.get_running_loop().run_in_executor(None, cfg.router.decide, text)
    return d.spec, d


def build_router(rt, base: LoadSpec, routes: list[str], examples: str | None = None, **settings: Any):
    """The Router of `--route NAME=MODEL` arguments (each model loaded with `base`'s options), its
    models loaded and its examples embedded now: a bad table fails at start-up."""
    from dataclasses import replace

    from ..runtime.routing import Router, parse_route, read_examples

    table: dict[str, LoadSpec] = {}
    for text in routes:
        name, model = parse_route(text)
        if name in table:
            raise InvalidRequest(f"--route {name}= is given twice.")
        table[name] = rt.spec(replace(base, path=rt.spec(model).path))
    return Router(rt, table, examples=read_examples(examples) if examples else None, **settings).prepare()


def header(d: Decision) -> dict[str, str]:
    """The decision as a response header, for clients that read no body field."""
    return {"X-A3B-Route": f"{d.route}; model={d.model}; score={d.score:.4f}; method={d.method}"}


__all__ = ["MAX_ROUTED_CHARS", "build_router", "decide", "header", "is_route", "route_text"]
