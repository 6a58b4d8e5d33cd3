"""`a3b serve`'s configuration: what the app is built with (the model, its id over the API, the
token and the browser origins it lets in, routing), apart from the app so the request handlers'
modules can name it without importing the app."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runtime.options import LoadSpec


@dataclass
class ServeConfig:
    spec: LoadSpec
    #: the model's id in /v1/models and the names a request's "model" may give
    model_id: str
    token: str | None = None
    #: browser Origins allowed (CORS); any other Origin is refused, as is any Origin when empty
    origins: tuple[str, ...] = ()
    #: bound to a loopback address: then the Host header must name the loopback too (a web page
    #: that rebinds its own name to 127.0.0.1 cannot reach the server)
    loopback: bool = True
    stats: dict[str, int] = field(default_factory=lambda: {"requests": 0, "errors": 0, "disconnects": 0})
    #: more ids over the same weights: with a LoRA adapter, the plain base beside it (id -> spec)
    others: dict[str, LoadSpec] = field(default_factory=dict)
    #: routing by task type (runtime/routing.py): the Router, and the name requests give to be routed
    router: Any = None
    route_name: str = "auto"


def model_id(spec: LoadSpec) -> str:
    """A model's id over the API: the file's stem (the adapter's, with a LoRA adapter), or the model
    name of a remote reference."""
    if spec.lora_path:
        return Path(spec.lora_path).stem
    if "://" in spec.path:
        frag = spec.path.partition("#")[2]
        return frag or spec.path.split("://", 1)[1].split("/", 1)[0]
    return Path(spec.path).stem
