"""`a3b serve` inside ComfyUI's process, sharing the weights its workflows hold.

Off unless the environment asks for it:

    A3B_SERVE=127.0.0.1:8080        (HOST:PORT; a non-loopback host needs a token)
    A3B_SERVE_TOKEN=some-secret     (optional on the loopback; clients send Authorization: Bearer ...)
    A3B_SERVE_MODEL=name.gguf       (optional; default: the embedded model)
    A3B_SERVE_ORIGINS=http://localhost:3000   (optional, comma-separated browser Origins to allow)

Its address and request counts appear in `get_runtime().status()["serve"]`, which the A3B sidebar shows.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from ..runtime.environment import env, env_list, switched_off
from ..runtime.options import SERVE_TOKEN

log = logging.getLogger("a3b.serve")

ENV = "A3B_SERVE"
_state: dict[str, Any] = {}
_lock = threading.Lock()


def maybe_start(environ: dict[str, str] | None = None) -> dict | None:
    """Start the server if $A3B_SERVE asks for it; its status, or None when off. Raises ValueError,
    OSError or an A3BError with what to change (a bad address, a port in use, a missing token)."""
    value = (env(ENV, environ) or "").strip()
    if not value or switched_off(value):
        return None
    with _lock:
        if _state.get("server") is not None:
            return _state["server"].status()
        from ..runtime import get_runtime
        from . import Server, parse_address

        rt = get_runtime()
        try:
            host, port = parse_address(value)
            spec = rt.spec(env("A3B_SERVE_MODEL", environ))
            origins = tuple(env_list("A3B_SERVE_ORIGINS", environ))
            srv = Server(spec, host, port, token=env(SERVE_TOKEN.env, environ), origins=origins).start()
        except Exception as e:
            message = f"{ENV}={value}: {type(e).__name__}: {e}"
            rt.status_providers["serve"] = lambda: {"error": message}
            raise
        _state["server"] = srv
        rt.status_providers["serve"] = srv.status
        return srv.status()


def stop() -> None:
    with _lock:
        srv = _state.pop("server", None)
    if srv is not None:
        srv.stop()
        from ..runtime import get_runtime

        get_runtime().status_providers.pop("serve", None)
