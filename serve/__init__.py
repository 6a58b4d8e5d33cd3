"""`a3b serve`: the process's runtime as an OpenAI-compatible HTTP server (and llama-server's /infill).

A thin adapter over the runtime, like the nodes and the language server: other tools (Open WebUI,
Continue, Zed, the openai client, llama.vim) share the weights this process already holds.
Starlette routes the requests and uvicorn serves them, on a thread with its own event loop, so it
runs the same inside ComfyUI (whose aiohttp loop it never touches) as on its own.

Loopback only unless told otherwise; a bearer token, when set, is required by every endpoint; any
browser Origin is refused unless allowed; a non-loopback address needs a token. Connections are
bounded in number and in the time they may send nothing (connections.py); each request answered
is one line on the logger `a3b.serve.access` (accesslog.py) unless `access_log` is off.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import replace
from typing import Any

from ..runtime.environment import env
from ..runtime.errors import InvalidRequest
from ..runtime.netguard import check_token, is_loopback
from ..runtime.options import SERVE_TOKEN, LoadSpec

log = logging.getLogger("a3b.serve")

TOKEN_ENV = SERVE_TOKEN.env


def parse_address(addr: str) -> tuple[str, int]:
    host, sep, port = str(addr).strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidRequest(f"{addr!r} is not HOST:PORT (e.g. 127.0.0.1:8080).")
    return host.strip("[]") or "127.0.0.1", int(port)


class Server:
    """One HTTP server over the runtime: `start()` on a thread, or `run()` in the foreground."""

    def __init__(self, spec: LoadSpec, host: str = "127.0.0.1", port: int = 8080, token: str | None = None,
                 origins: tuple[str, ...] = (), name: str | None = None, *, access_log: bool = True,
                 max_connections: int | None = None, header_timeout: float | None = None, router: Any = None,
                 route_name: str = "auto"):
        import uvicorn

        from . import connections
        from .accesslog import AccessLog
        from .app import create_app
        from .config import ServeConfig, model_id

        token = check_token(token or env(TOKEN_ENV), f"--token or {TOKEN_ENV}")
        if not is_loopback(host) and not token:
            raise InvalidRequest(f"Listening on {host} (not the loopback) needs a token: give --token or set "
                                 f"{TOKEN_ENV}, so that only your clients can use the model.")
        # with a LoRA adapter the plain base is served too, over the same weights (a context each)
        base = replace(spec, lora_path=None) if spec.lora_path else None
        self.cfg = ServeConfig(spec=spec, model_id=name or model_id(spec), token=token, origins=tuple(origins),
                               loopback=is_loopback(host), others={model_id(base): base} if base else {},
                               router=router, route_name=route_name)
        if router is not None:   # every route's model is served by its own id too; the table by route_name
            for route, rspec in router.routes.items():
                rid = self.cfg.model_id if rspec == spec else model_id(rspec)
                if rspec != spec:
                    self.cfg.others.setdefault(rid, rspec)
                router.names[route] = rid
        self.host, self._port = host, port
        self.overload = connections.Overload(max_connections or connections.MAX_CONNECTIONS)
        app = create_app(self.cfg)
        config = uvicorn.Config(AccessLog(app) if access_log else app, host=host, port=port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=3, access_log=False,
                                timeout_keep_alive=connections.KEEP_ALIVE_S,
                                http=connections.protocol_class(self.overload,
                                                                header_timeout or connections.HEADER_TIMEOUT_S))
        self.server = connections.UvicornServer(config, self.overload)
        self.sock: socket.socket | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def bind(self) -> Server:
        """Take the address now (port 0: a free port), so that `url` is the real one before serving;
        InvalidRequest saying what to change when the address is in use or not this machine's."""
        if self.sock is None:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            try:
                self.sock = socket.create_server((self.host, self._port), family=family,
                                                 backlog=self.server.config.backlog)
            except OSError as e:
                raise InvalidRequest(f"Cannot listen on {self.host}:{self._port}: {e.strerror or e}; choose "
                                     "another address or port.") from e
        return self

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1] if self.sock is not None else self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def run(self) -> None:
        """Serve in this thread until interrupted (Ctrl-C) or stop()."""
        self.server.run(sockets=[self.bind().sock])

    def start(self, timeout: float = 15.0) -> Server:
        """Serve on a daemon thread; returns once listening (or raises why not)."""
        sockets = [self.bind().sock]

        def run():
            try:
                self.server.run(sockets=sockets)
            except BaseException as e:  # noqa: BLE001 - reported to the starting thread
                self.error = e

        self.thread = threading.Thread(target=run, name="a3b-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self.error is not None or not self.thread.is_alive():
                raise OSError(f"a3b serve could not listen on {self.host}:{self.port}: "
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
        elif self.sock is not None:   # bound, never served
            self.sock.close()

    def status(self) -> dict[str, Any]:
        return {"url": self.url, "model": self.cfg.model_id, "token": bool(self.cfg.token),
                "origins": list(self.cfg.origins), **self.cfg.stats, "refused": self.overload.refused}
