"""Who may drive the model over a network socket: loopback addresses, bearer tokens, Host and Origin.

The one set of rules for every listener of the process: `a3b serve` (HTTP) and the language server's
TCP and WebSocket transports. A web page the user visits can reach a loopback port, so these servers
refuse browser Origins they were not told to allow and, when bound to the loopback, any Host header
that does not name the loopback (a page that rebinds its own domain name to 127.0.0.1 sends its own
name there).
"""
from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from .errors import InvalidRequest


def is_loopback(host: str) -> bool:
    """Whether `host` (a name, an IPv4 or IPv6 address, bracketed or with a zone) is the loopback."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def host_header_ok(host: str) -> bool:
    """Whether an HTTP Host header ("name", "name:port", "[v6]:port") names the loopback."""
    if host.startswith("["):
        name = host.split("]", 1)[0] + "]"
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return bool(name) and is_loopback(name)


def origin_ok(origin: str | None, allowed: tuple[str, ...] = ()) -> bool:
    """Whether a request with this Origin header (None: not sent, so not from a browser page) may go on."""
    return origin is None or origin in allowed


def token_ok(expected: str | None, given: Any) -> bool:
    """Whether `given` is the token (compared in constant time); anything goes when none is set."""
    if expected is None:
        return True
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def check_token(token: str | None, source: str) -> str | None:
    """A token as a server takes it at start (None or "" for none), or InvalidRequest saying why no
    client could ever send it: clients strip the spaces around a header value, and an HTTP header
    carries ASCII only. `source` names where it came from, for the message."""
    if not token:
        return None
    if token != token.strip():
        raise InvalidRequest(f"The token from {source} has spaces or line breaks around it, which no client "
                             "sends: it could never match. Remove them.")
    if not all(" " <= c <= "~" for c in token):
        raise InvalidRequest(f"The token from {source} has characters outside printable ASCII, which an "
                             "Authorization header cannot carry: it could never match. Choose another.")
    return token
