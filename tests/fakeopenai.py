"""A scripted OpenAI-compatible server on a loopback port, for the remote engine's fast tests.

Each test says what the server answers: `FakeOpenAI(routes)` where a route maps a path to a reply
function `reply(body) -> (status, headers, chunks)`; chunks are bytes sent one after another (a
float in their place sleeps that long), so a test can script a stream that pings forever, sends one
huge line, or an event of the wrong shape. Every request's path and JSON body is recorded in
`requests`. A server stopped with `stop()` ends every reply it is still sending.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Reply = tuple[int, dict[str, str], Iterable[bytes | float]]


def json_reply(obj, status: int = 200) -> Reply:
    data = json.dumps(obj).encode()
    return status, {"Content-Type": "application/json", "Content-Length": str(len(data))}, [data]


def sse_reply(chunks: Iterable[bytes | float]) -> Reply:
    return 200, {"Content-Type": "text/event-stream"}, chunks


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def text_event(text: str, finish: str | None = None) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


MODELS = json_reply({"object": "list", "data": [{"id": "m"}]})


class FakeOpenAI:
    def __init__(self, routes: dict[str, Callable[[dict], Reply]]):
        self.routes = {"/v1/models": lambda body: MODELS, **routes}
        self.requests: list[tuple[str, dict]] = []
        self.stopped = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):   # quiet
                pass

            def _answer(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else {}
                fake.requests.append((self.path, body))
                route = fake.routes.get(self.path)
                if route is None:
                    status, headers, chunks = 404, {"Content-Type": "application/json"}, [b'{"error": "not found"}']
                else:
                    status, headers, chunks = route(body)
                chunked = "Content-Length" not in headers
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    for c in chunks:
                        if fake.stopped.is_set():
                            break
                        if isinstance(c, float):
                            time.sleep(c)
                            continue
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(c), c) if chunked else c)
                        self.wfile.flush()
                    if chunked:
                        self.wfile.write(b"0\r\n\r\n")
                except OSError:   # the client went away
                    pass
                self.close_connection = True

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]

    def stop(self) -> None:
        self.stopped.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeOpenAI:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def forever(chunk: bytes, every: float) -> Iterable[bytes | float]:
    """`chunk` every `every` seconds, until the server stops."""
    while True:
        yield chunk
        yield every
