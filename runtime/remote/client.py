"""HTTP to an OpenAI-compatible server: model references, the API key, errors, server-sent events,
and the bounds on what a server may send.

A model reference is the server's API base URL, `http(s)://HOST:PORT/v1`, with the model's name
after `#` when the server serves several. The API key never travels in the reference (a workflow or
an editor setting would store it): it comes from `$A3B_REMOTE_API_KEY`, and a URL that carries
credentials (`http://user:key@host/...`) is refused.

References that arrive over a network API (a ComfyUI `/prompt`, an editor's settings) may only name
servers listed in `$A3B_REMOTE_MODELS` (comma-separated references; they also fill the A3BLoader
dropdown), the way file names may only name files inside the model folders: otherwise a workflow
from anywhere could point the process, and its API key, at any host it can reach.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from ..environment import env, env_list, env_number
from ..errors import (InvalidRequest, ModelNotFound, PathNotAllowed, PromptTooLong, RemoteAuthFailed, RemoteError,
                      RemoteProtocolError, RemoteUnreachable)

SCHEMES = ("http", "https")
KEY_ENV = "A3B_REMOTE_API_KEY"
LIST_ENV = "A3B_REMOTE_MODELS"
TIMEOUT_ENV = "A3B_REMOTE_TIMEOUT"
#: what Client.events yields for `data: [DONE]`, the end of a complete answer
DONE: dict = {}
#: what Client.events yields for anything received that is not an event payload (an SSE comment such
#: as `: ping`, a blank line, part of a long line): the caller's clock can tick
KEEPALIVE: dict = {}

#: The most a server may send: one answer (a JSON body), and one streamed event (one line, which
#: holds one token's text). Well above what a model list, a tokenization or a pack of embeddings
#: takes (8 texts x 8192 dimensions as JSON text: about 1.5 MB; the per-token vectors some servers
#: answer for one text of 256 tokens x 4096 dimensions: about 13 MB); a server that sends more is
#: broken or hostile, and reading it whole would take the host's memory.
MAX_ANSWER_BYTES = 16 << 20
MAX_EVENT_BYTES = 4 << 20


@dataclass(frozen=True)
class RemoteRef:
    url: str          # the reference as given (fragment included)
    base: str         # the API base, e.g. http://host:8080/v1
    root: str         # the server root, where llama-server keeps /infill, /tokenize and /props
    model: str | None

    @property
    def origin(self) -> str:
        u = urlsplit(self.base)
        return f"{u.scheme}://{u.hostname}:{u.port or (443 if u.scheme == 'https' else 80)}"


def parse_ref(ref: str) -> RemoteRef:
    """The parts of `http(s)://HOST:PORT/v1[#MODEL]`; InvalidRequest for anything else."""
    try:
        u = urlsplit(str(ref).strip())
        port = u.port
    except ValueError as e:
        raise InvalidRequest(f"{ref!r} is not a usable server URL ({e}).") from None
    if u.scheme.lower() not in SCHEMES or not u.hostname:
        raise InvalidRequest(f"{ref!r} is not a server URL; give http(s)://HOST:PORT/v1.")
    if u.username is not None or u.password is not None:
        raise InvalidRequest(f"The server URL for {u.hostname} carries credentials; remove them from the URL "
                             f"(it would be stored in workflows and settings) and set {KEY_ENV} instead.")
    if u.query:
        raise InvalidRequest(f"The server URL {ref!r} has a query string; give http(s)://HOST:PORT/v1[#MODEL].")
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    netloc = f"{host}:{port}" if port else host
    path = u.path.rstrip("/")
    base = f"{u.scheme.lower()}://{netloc}{path}"
    root = base[:-3] if path.endswith("/v1") else base
    return RemoteRef(url=str(ref), base=base, root=root, model=u.fragment or None)


def listed() -> list[str]:
    """The references in $A3B_REMOTE_MODELS (the ones network callers may use)."""
    return env_list(LIST_ENV)


def check_allowed(ref: str, restrict: bool) -> RemoteRef:
    r = parse_ref(ref)
    if restrict and not any(_same_server(r, x) for x in listed()):
        raise PathNotAllowed(f"The server {r.base} is not listed in {LIST_ENV}; add {r.url} there (comma-separated) "
                             "to let workflows and editors use it.")
    return r


def _same_server(r: RemoteRef, other: str) -> bool:
    try:
        o = parse_ref(other)
    except InvalidRequest:
        return False
    return o.base == r.base


def timeout() -> float:
    """Seconds a server may stay silent: without an answer, and in a stream without a token
    (whatever else it sends meanwhile)."""
    return float(env_number(TIMEOUT_ENV))


class Client:
    """A connection pool to one server, with the API key and errors that say what to do."""

    def __init__(self, ref: RemoteRef):
        self.ref = ref
        key = env(KEY_ENV)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # no proxies from the environment: a loopback server must not be sent through one
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout(), connect=10.0), trust_env=False)

    def close(self) -> None:
        self.http.close()

    def url(self, path: str, root: bool = False) -> str:
        return (self.ref.root if root else self.ref.base) + path

    def get(self, path: str, root: bool = False, expect_json: bool = True) -> Any:
        return self.request("GET", path, root=root, expect_json=expect_json)

    def post(self, path: str, body: dict, root: bool = False) -> Any:
        return self.request("POST", path, body, root=root)

    def try_post(self, path: str, body: dict, root: bool = False) -> Any | None:
        """The JSON answer, or None when the server does not have this endpoint (or not in this shape)."""
        return self.request("POST", path, body, root=root, missing_ok=True)

    def status(self, path: str, root: bool = False, body: dict | None = None) -> int:
        """The HTTP status of GET `path`, or of POST `body` to it (the answer's body is not read)."""
        try:
            with self.http.stream("GET" if body is None else "POST", self.url(path, root), json=body) as r:
                return r.status_code
        except httpx.HTTPError as e:
            raise self.unreachable(e) from None

    def request(self, method: str, path: str, body: dict | None = None, root: bool = False,
                expect_json: bool = True, missing_ok: bool = False) -> Any:
        """The JSON answer of one request, read up to MAX_ANSWER_BYTES and within the timeout;
        with `missing_ok`, None where the server does not have the endpoint."""
        try:
            with self.http.stream(method, self.url(path, root), json=body) as r:
                if missing_ok and r.status_code in (400, 404, 405, 422, 501):
                    return None
                self.raise_for(r)
                raw = self._read(r)
        except httpx.HTTPError as e:
            raise self.unreachable(e) from None
        return self._json(r, raw, expect_json)

    def _read(self, r: httpx.Response) -> bytes:
        """The body, refused past MAX_ANSWER_BYTES or when it trickles in for longer than the timeout."""
        limit = timeout()
        t0 = time.monotonic()
        parts, size = [], 0
        for chunk in r.iter_bytes():
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise RemoteProtocolError(f"The server at {self.ref.base} answered {r.request.method} "
                                          f"{r.request.url.path} with more than {MAX_ANSWER_BYTES >> 20} MB; "
                                          "that is not an answer this client reads.")
            if time.monotonic() - t0 > limit:
                raise RemoteUnreachable(f"The server at {self.ref.base} did not finish its answer in {limit:g} s; "
                                        f"{TIMEOUT_ENV} sets the limit in seconds.")
            parts.append(chunk)
        return b"".join(parts)

    def unreachable(self, e: Exception) -> RemoteError:
        if isinstance(e, httpx.TimeoutException):
            return RemoteUnreachable(f"The server at {self.ref.base} did not answer in time ({type(e).__name__}). "
                                     f"Check that it is running and not overloaded; {TIMEOUT_ENV} sets the limit "
                                     "in seconds.")
        if isinstance(e, httpx.RemoteProtocolError):
            return RemoteProtocolError(f"The server at {self.ref.base} closed the connection in the middle of an "
                                       f"answer ({e}). Check its log; it may have crashed or restarted.")
        return RemoteUnreachable(f"The server at {self.ref.base} is not reachable ({type(e).__name__}: {e}). "
                                 "Start it, or check the host and port in the model URL.")

    def raise_for(self, r: httpx.Response) -> None:
        if r.status_code < 400:
            return
        try:
            msg, code = _error_message(self._read(r))
        except (httpx.HTTPError, RemoteError):
            msg, code = "", ""
        where = f"The server at {self.ref.base}"
        if r.status_code in (401, 403):
            raise RemoteAuthFailed(f"{where} refused the request (HTTP {r.status_code}: {msg or 'unauthorized'}). "
                                   f"Set {KEY_ENV} to the server's API key.")
        low = msg.lower()
        too_long = "context" in low and any(w in low for w in ("exceed", "too long", "longer", "maximum", "larger"))
        if code in ("context_length_exceeded", "prompt_too_long") or too_long:
            raise PromptTooLong(f"{where} says the request is larger than its context: {msg}. Shorten the "
                                "prompt or max_tokens, or start the server with a larger context.")
        if r.status_code == 404 and "model" in low:
            raise ModelNotFound(f"{where}: {msg}. Check the model name after '#' in the URL against GET /v1/models.")
        raise RemoteError(f"{where} answered HTTP {r.status_code} to {r.request.method} {r.request.url.path}: "
                          f"{msg or r.reason_phrase}")

    def _json(self, r: httpx.Response, raw: bytes, expect_json: bool) -> Any:
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            if not expect_json:
                return None
            kind = r.headers.get("content-type", "no content type")
            raise RemoteProtocolError(f"The server at {self.ref.base} is not an OpenAI-compatible server: "
                                      f"{r.request.method} {r.request.url.path} answered {kind}, not JSON. Check the "
                                      "URL: it should be the API base, usually ending in /v1.") from None

    def events(self, r: httpx.Response) -> Iterator[dict]:
        """The JSON payloads of a server-sent event stream, then DONE if it ended with `data: [DONE]`;
        KEEPALIVE for whatever else arrives (comments, blank lines, part of a line), so that the
        caller's timeout sees time pass however the server keeps the connection busy."""
        try:
            for line in self._lines(r):
                if line is None or not line.startswith("data:"):
                    if line is not None and line.startswith("error:"):
                        raise RemoteError(f"The server at {self.ref.base} reported: {line[6:].strip()[:300]}")
                    yield KEEPALIVE
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    yield DONE
                    return
                try:
                    obj = json.loads(data)
                except (json.JSONDecodeError, RecursionError):
                    raise RemoteProtocolError(f"The server at {self.ref.base} sent an event that is not JSON: "
                                              f"{data[:80]!r}") from None
                if isinstance(obj, dict) and "error" in obj and not obj.get("choices"):
                    err = obj["error"]
                    raise RemoteError(f"The server at {self.ref.base} reported: "
                                      f"{str(err.get('message', err) if isinstance(err, dict) else err)[:300]}")
                if not isinstance(obj, dict):
                    raise RemoteProtocolError(f"The server at {self.ref.base} sent an event that is not an object.")
                yield obj
        except httpx.HTTPError as e:
            raise self.unreachable(e) from None

    def _lines(self, r: httpx.Response) -> Iterator[str | None]:
        """The stream's lines (decoded), and None for each chunk that ends none; a line longer than
        MAX_EVENT_BYTES is refused. Linear in what arrives, however it is cut into chunks."""
        parts: list[bytes] = []   # the line so far
        size = 0
        for chunk in r.iter_bytes():
            start = 0
            while (nl := chunk.find(b"\n", start)) >= 0:
                size += nl - start
                self._check_event_size(size)
                line = b"".join(parts) + chunk[start:nl]
                parts, size, start = [], 0, nl + 1
                yield line.rstrip(b"\r").decode("utf-8", "replace")
            if start < len(chunk):
                parts.append(chunk[start:])
                size += len(chunk) - start
                self._check_event_size(size)
            if start == 0:
                yield None
        if parts:
            yield b"".join(parts).rstrip(b"\r").decode("utf-8", "replace")

    def _check_event_size(self, size: int) -> None:
        if size > MAX_EVENT_BYTES:
            raise RemoteProtocolError(f"The server at {self.ref.base} sent an event longer than "
                                      f"{MAX_EVENT_BYTES >> 20} MB; that is not a token this client reads.")


def _error_message(raw: bytes) -> tuple[str, str]:
    """The message and code of an error answer (OpenAI's {"error": {...}} or FastAPI's {"detail"})."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return raw[:200].decode("utf-8", "replace").strip(), ""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            return str(err.get("message") or err), str(err.get("code") or err.get("type") or "")
        return str(err), ""
    return str(body)[:200], ""
