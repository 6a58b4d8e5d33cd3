"""The language server inside another process (ComfyUI's), sharing that process's runtime.

Off unless the environment asks for it:

    A3B_LSP=tcp:127.0.0.1:7011      (or ws:127.0.0.1:7012)
    A3B_LSP_TOKEN=some-secret        (optional; clients send it as initializationOptions.token)

The server runs on a daemon thread with its own event loop; completions go through the same
`get_runtime()` the ComfyUI nodes use, so the weights are loaded once and editor requests take
priority over workflow generations in the one scheduler. Its address, clients and statistics appear
in `get_runtime().status()["lsp"]`.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

from ..runtime.environment import env, switched_off
from ..runtime.options import LSP_TOKEN

ENV = "A3B_LSP"
_state: dict[str, Any] = {}
_lock = threading.Lock()


def parse_env(value: str) -> tuple[str, str, int]:
    kind, sep, addr = value.strip().partition(":")
    kind = kind.lower()
    if not sep or kind not in ("tcp", "ws"):
        raise ValueError(f"{ENV}={value!r}: expected tcp:HOST:PORT or ws:HOST:PORT, e.g. tcp:127.0.0.1:7011.")
    from .transport import parse_address

    host, port = parse_address(addr)
    return kind, host, port


def maybe_start(environ: dict[str, str] | None = None) -> dict | None:
    """Start the in-process server if $A3B_LSP asks for it; its status dict, or None when off.

    Calling it again returns the running server's status. Errors (a bad address, a port in use)
    raise ValueError/OSError with a message that says what to change.
    """
    value = (env(ENV, environ) or "").strip()
    if not value or switched_off(value):
        return None
    with _lock:
        if _state.get("listener") is not None:
            return status()
        kind, host, port = parse_env(value)
        token = env(LSP_TOKEN.env, environ)
        return _start(kind, host, port, token)


def _start(kind: str, host: str, port: int, token: str | None) -> dict:
    from ..runtime import get_runtime
    from .engine import Engine
    from .transport import start_tcp, start_ws

    engine = Engine(address=None)
    ready = threading.Event()
    box: dict[str, Any] = {}

    def run():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            lst = loop.run_until_complete((start_tcp if kind == "tcp" else start_ws)(engine, host, port, token))
        except BaseException as e:  # noqa: BLE001 - handed to the starting thread, which reports it
            box["error"] = e
            ready.set()
            return
        engine.address = lst.address
        box["listener"], box["loop"] = lst, loop
        ready.set()
        try:
            loop.run_until_complete(lst.server.serve_forever())
        except BaseException:  # noqa: BLE001 - stop() ends serve_forever with CancelledError; never crash the host
            pass
        finally:
            lst.close()
            loop.close()

    t = threading.Thread(target=run, name="a3b-lsp-inprocess", daemon=True)
    t.start()
    ready.wait(30)
    if "error" in box:
        raise OSError(f"A3B language server could not listen on {kind}://{host}:{port}: {box['error']}")
    _state.update(engine=engine, thread=t, token=token is not None, **box)
    get_runtime().status_providers["lsp"] = status
    return status()   # the caller logs the address (the pack's __init__, once)


def status() -> dict:
    eng = _state.get("engine")
    lst = _state.get("listener")
    if eng is None or lst is None:
        return {"running": False}
    st = eng.status()
    return {"running": True, "address": lst.address, "token_required": _state.get("token", False),
            "clients": st["clients"], "refused": lst.refused, "stats": st}


def stop() -> None:
    """Stop the in-process server (tests; ComfyUI simply exits)."""
    with _lock:
        lst, loop = _state.get("listener"), _state.get("loop")
        if lst is None:
            return
        loop.call_soon_threadsafe(lst.close)
        _state.get("thread").join(10)
        _state.get("engine").close()
        _state.clear()
        from ..runtime import get_runtime

        get_runtime().status_providers.pop("lsp", None)
