"""HTTP to an OpenAI-compatible server: model references, the API key, errors, server-sent events.

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
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from ..errors import (InvalidRequest, ModelNotFound, PathNotAllowed, PromptTooLong, RemoteAuthFailed, RemoteError,
                      RemoteProtocolError, RemoteUnreachable)

SCHEMES = ("http", "https")
KEY_ENV = "A3B_REMOTE_API_KEY"
LIST_ENV = "A3B_REMOTE_MODELS"
TIMEOUT_ENV = "A3B_REMOTE_TIMEOUT"
#: what Client.events yields for `data: [DONE]`, the end of a complete answer
DONE: dict = {}


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
    return [r.strip() for r in os.environ.get(LIST_ENV, "").split(",") if r.strip()]


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
    try:
        return float(os.environ.get(TIMEOUT_ENV, "") or 300)
    except ValueError:
        return 300.0


class Client:
    """A connection pool to one server, with the API key and errors that say what to do."""

    def __init__(self, ref: RemoteRef):
        self.ref = ref
        key = os.environ.get(KEY_ENV)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # no proxies from the environment: a loopback server must not be sent through one
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout(), connect=10.0), trust_env=False)

    def close(self) -> None:
        self.http.close()

    def url(self, path: str, root: bool = False) -> str:
        return (self.ref.root if root else self.ref.base) + path

    def get(self, path: str, root: bool = False, expect_json: bool = True) -> Any:
        return self._json(self._send("GET", path, root=root), expect_json)

    def post(self, path: str, body: dict, root: bool = False) -> Any:
        return self._json(self._send("POST", path, body, root=root), True)

    def try_post(self, path: str, body: dict, root: bool = False) -> Any | None:
        """The JSON answer, or None when the server does not have this endpoint (or not in this shape)."""
        try:
            r = self.http.post(self.url(path, root), json=body)
        except httpx.HTTPError as e:
            raise self.unreachable(e) from None
        if r.status_code in (400, 404, 405, 422, 501):
            return None
        self.raise_for(r)
        return self._json(r, True)

    def _send(self, method: str, path: str, body: dict | None = None, root: bool = False) -> httpx.Response:
        try:
            r = self.http.request(method, self.url(path, root), json=body)
        except httpx.HTTPError as e:
            raise self.unreachable(e) from None
        self.raise_for(r)
        return r

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
            r.read()
            msg, code = _error_message(r)
        except httpx.HTTPError:
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

    def _json(self, r: httpx.Response, expect_json: bool) -> Any:
        try:
            return r.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            if not expect_json:
                return None
            kind = r.headers.get("content-type", "no content type")
            raise RemoteProtocolError(f"The server at {self.ref.base} is not an OpenAI-compatible server: "
                                      f"{r.request.method} {r.request.url.path} answered {kind}, not JSON. Check the "
                                      "URL: it should be the API base, usually ending in /v1.") from None

    def events(self, r: httpx.Response) -> Iterator[dict]:
        """The JSON payloads of a server-sent event stream, then DONE if it ended with `data: [DONE]`."""
        try:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    if line.startswith("error:"):
                        raise RemoteError(f"The server at {self.ref.base} reported: {line[6:].strip()}")
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    yield DONE
                    return
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    raise RemoteProtocolError(f"The server at {self.ref.base} sent an event that is not JSON: "
                                              f"{data[:80]!r}") from None
                if isinstance(obj, dict) and "error" in obj and not obj.get("choices"):
                    err = obj["error"]
                    raise RemoteError(f"The server at {self.ref.base} reported: "
                                      f"{err.get('message', err) if isinstance(err, dict) else err}")
                if not isinstance(obj, dict):
                    raise RemoteProtocolError(f"The server at {self.ref.base} sent an event that is not an object.")
                yield obj
        except httpx.HTTPError as e:
            raise self.unreachable(e) from None


def _error_message(r: httpx.Response) -> tuple[str, str]:
    """The message and code of an error answer (OpenAI's {"error": {...}} or FastAPI's {"detail"})."""
    try:
        body = r.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return r.text[:200].strip(), ""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            return str(err.get("message") or err), str(err.get("code") or err.get("type") or "")
        return str(err), ""
    return str(body)[:200], ""
