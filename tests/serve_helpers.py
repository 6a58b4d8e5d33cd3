"""What the fast-tier tests of `a3b serve` share: a server over the fake model, a client, a raw socket.

conftest.py makes `server` and `client` fixtures of every test module; each module that uses them
gets its own server.
"""
from __future__ import annotations

import json
import socket

import httpx
import pytest

TOKEN = "s3cret-token"
MODEL = "fake://serve?fim=1&delay_ms=3"
TEXT = "The quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def server(fake_engine):
    from comfyui_a3b.runtime import get_runtime
    from comfyui_a3b.serve import Server

    rt = get_runtime()
    srv = Server(rt.spec(MODEL, n_parallel=4, n_ctx=512), "127.0.0.1", 0, token=TOKEN,
                 origins=("http://allowed.test",), name="fakemodel").start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=20, trust_env=False) as c:
        yield c


def raw_request(port: int, path: str, body: dict | bytes, headers: bytes = b"", length: int | None = None
                ) -> socket.socket:
    """A request sent over a plain socket, which the caller may close at any moment (`length`: the
    Content-Length announced, when not the body's)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n%sContent-Length: %d"
              b"\r\n\r\n%s" % (path.encode(), headers, len(data) if length is None else length, data))
    return s
