"""A3B Router: one model handle over two loaded models, each prompt sent to the model its task needs
(code, algorithms and maths to `code`, the rest to `default`), as `a3b serve --route` does.

The decision is runtime/routing.py's (code signs, then the prompt's head against example prompts);
the router of a pair of models is built once (its examples embedded once) and kept while the
process runs, at most a few of them. No ComfyUI import here.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..runtime import LoadSpec, get_runtime
from ..runtime.errors import InvalidRequest
from ..runtime.options import ROUTE_EMBEDDING, check
from ..runtime.routing import CODE, DEFAULT, Decision, Router

#: routers kept (each holds only its examples' vectors; the models live in the store)
MAX_ROUTERS = 4


@dataclass(frozen=True)
class RoutedModel:
    """A handle that stands for two loaded models; A3BGenerate routes each prompt, A3BEmbed uses the
    default model."""

    default: LoadSpec
    code: LoadSpec
    embedding: str = ROUTE_EMBEDDING.default


_routers: OrderedDict[RoutedModel, Router] = OrderedDict()
_lock = threading.Lock()


def routed_model(default: LoadSpec, code: LoadSpec, embedding: str = ROUTE_EMBEDDING.default) -> RoutedModel:
    """The handle of a route table over two loaded models; its router is built now (both models
    loaded, the examples embedded), so a bad pair fails on this node."""
    for name, spec in (("default", default), ("code", code)):
        if not isinstance(spec, LoadSpec):
            raise InvalidRequest(f"A3B Router's {name} input must come from an A3B Loader (or A3B Prune) node, "
                                 f"not {type(spec).__name__}.")
    handle = RoutedModel(default, code, check(ROUTE_EMBEDDING, embedding))
    router_of(handle)
    return handle


def router_of(handle: RoutedModel) -> Router:
    with _lock:
        r = _routers.get(handle)
        if r is not None:
            _routers.move_to_end(handle)
            return r
    r = Router(get_runtime(), {DEFAULT: handle.default, CODE: handle.code}, embedding=handle.embedding).prepare()
    with _lock:
        _routers[handle] = r
        while len(_routers) > MAX_ROUTERS:
            _routers.popitem(last=False)
    return r


def resolve(model, text: str) -> tuple[LoadSpec, Decision | None]:
    """The model a prompt goes to: `model` itself, or the route its text matches."""
    if not isinstance(model, RoutedModel):
        return model, None
    d = router_of(model).decide(text)
    return d.spec, d


def describe(decision: Decision) -> str:
    return (f"routed to {decision.route} ({decision.method}, score {decision.score:.3f}, "
            f"{decision.ms:.1f} ms): {decision.spec.path.rsplit('/', 1)[-1]}")


__all__ = ["MAX_ROUTERS", "RoutedModel", "describe", "resolve", "routed_model", "router_of"]
