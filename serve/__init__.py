"""`a3b serve`: the process's runtime as an OpenAI-compatible HTTP server (and llama-server's /infill).

A thin adapter over the runtime, like the nodes and the language server: other tools (Open WebUI,
Continue, Zed, the openai client, llama.vim) share the weights this process already holds.
Starlette routes the requests and uvicorn serves them, on a thread with its own event loop, so it
runs the same inside ComfyUI (whose aiohttp loop it never touches) as on its own.

Loopback only unless told otherwise; a bearer token, when set, is required by every endpoint; any
browser Origin is refused unless allowed; a non-loopback address needs a token.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ..runtime.errors import InvalidRequest
from ..runtime.netguard import check_token, is_loopback
from ..runtime.options import LoadSpec

log = logging.getLogger("a3b.serve")

TOKEN_ENV = "A3B_SERVE_TOKEN"


def parse_address(addr: str) -> tuple[str, int]:
    host, sep, port = str(addr).strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidRequest(f"{addr!r} is not HOST:PORT (e.g. 127.0.0.1:8080).")
    return host.strip("[]") or "127.0.0.1", int(port)


class Server:
    """One HTTP server over the runtime: `start()` on a thread, or `run()` in the foreground."""

    def __init__(self, spec: LoadSpec, host: str = "127.0.0.1", port: int = 8080, token: str | None = None,
                 origins: tuple[str, ...] = (), name: str | None = None):
        import uvicorn

        from .app import ServeConfig, create_app, model_id

        token = check_token(token or os.environ.get(TOKEN_ENV), f"--token or {TOKEN_ENV}")
        if not is_loopback(host) and not token:
            raise InvalidRequest(f"Listening on {host} (not the loopback) needs a token: give --token or set "
                                 f"{TOKEN_ENV}, so that only your clients can use the model.")
        self.cfg = ServeConfig(spec=spec, model_id=name or model_id(spec), token=token, origins=tuple(origins),
                               loopback=is_loopback(host))
        self.host = host
        config = uvicorn.Config(create_app(self.cfg), host=host, port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=3, access_log=False)
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def port(self) -> int:
        for s in getattr(self.server, "servers", []) or []:
            for sock in s.sockets:
                return sock.getsockname()[1]
        return self.server.config.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def run(self) -> None:
        """Serve in this thread until interrupted (Ctrl-C) or stop()."""
        self.server.run()

    def start(self, timeout: float = 15.0) -> Server:
        """Serve on a daemon thread; returns once listening (or raises why not)."""
        def run():
            try:
                self.server.run()
            except BaseException as e:  # noqa: BLE001 - reported to the starting thread
                self.error = e

        self.thread = threading.Thread(target=run, name="a3b-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self.error is not None or not self.thread.is_alive():
                raise OSError(f"a3b serve could not listen on {self.host}:{self.server.config.port}: "
                              f"{self.error or 'the address is in use or not available'}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"a3b serve did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)

    def status(self) -> dict[str, Any]:
        return {"url": self.url, "model": self.cfg.model_id, "token": bool(self.cfg.token),
                "origins": list(self.cfg.origins), **self.cfg.stats}
