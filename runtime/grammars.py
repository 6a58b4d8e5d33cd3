"""Structured output's checks and bounds, before anything is compiled (llama/grammar.py compiles).

* Size: a json_schema (as JSON text) or a GBNF grammar larger than A3B_GRAMMAR_MAX_BYTES is refused
  with a message naming the bound, in microseconds, before any compiler sees it.
* Keywords: every keyword of the schema that the compiler cannot enforce (`unsupported`) is named in
  one message, with where it is, rather than dropped: an answer that ignores `uniqueItems` would
  still be "valid" to the caller who asked for unique items. The compiler (llguidance) names only
  the first subschema's; this walk names them all.
* Time: `compile_bounded` runs a compilation on a small pool of threads of its own, never on the
  model's worker thread nor an event loop, and waits at most A3B_GRAMMAR_TIMEOUT_S for it (the
  compiler's own limits bound its work too); a caller that leaves (`abandoned`) stops waiting at once.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from .environment import env_number
from .errors import Cancelled, InvalidRequest
from .options import GRAMMAR_MAX_BYTES, GRAMMAR_TIMEOUT_S

T = TypeVar("T")

#: JSON Schema keywords (2020-12 and draft 7) that constrain an answer but that the compiler cannot
#: enforce: refused by name. Annotations (title, description, examples, contentEncoding, ...) do not
#: constrain a validator's verdict and are accepted.
UNSUPPORTED = frozenset({
    "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedItems", "unevaluatedProperties",
    "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor",
})
#: string formats the compiler enforces (llguidance's list)
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"})
#: keywords whose value is one subschema / a list of them / an object of them
ONE_SCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
SCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def max_bytes() -> int:
    n = env_number("A3B_GRAMMAR_MAX_BYTES", int)
    return GRAMMAR_MAX_BYTES.default if n is None or n <= 0 else int(n)


def timeout_s() -> float:
    n = env_number("A3B_GRAMMAR_TIMEOUT_S", float)
    return GRAMMAR_TIMEOUT_S.default if n is None or not n > 0 else float(n)


def check_size(json_schema: Any, grammar: str | None) -> None:
    """InvalidRequest when the schema's JSON text or the grammar is over A3B_GRAMMAR_MAX_BYTES."""
    limit = max_bytes()
    if json_schema is not None:
        n = len(json.dumps(json_schema, allow_nan=False, separators=(",", ":")).encode("utf-8"))
        what = "json_schema"
    elif grammar is not None:
        n = len(grammar.encode("utf-8", "surrogatepass"))
        what = "grammar"
    else:
        return
    if n > limit:
        raise InvalidRequest(f"The {what} is {n} bytes; at most {limit} are compiled (A3B_GRAMMAR_MAX_BYTES).")


def _pointer(path: tuple[str, ...]) -> str:
    return "/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in path) if path else "(the root)"


def unsupported(schema: Any) -> list[str]:
    """Every keyword (and string format) of `schema` the compiler cannot enforce, as
    `keyword at /json/pointer`, in document order. An explicit stack: no recursion over user data."""
    found: list[str] = []
    stack: list[tuple[Any, tuple[str, ...]]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in node:
            if key in UNSUPPORTED:
                found.append(f"{key} at {_pointer(path)}")
        fmt = node.get("format")
        types = node.get("type")
        stringy = types is None or types == "string" or (isinstance(types, list) and "string" in types)
        if isinstance(fmt, str) and stringy and fmt not in FORMATS:
            found.append(f"format {fmt!r} at {_pointer(path)}")
        children: list[tuple[Any, tuple[str, ...]]] = []
        for key in ONE_SCHEMA:
            if isinstance(node.get(key), dict):
                children.append((node[key], (*path, key)))
        for key in SCHEMA_LIST:
            if isinstance(node.get(key), list):
                children += [(s, (*path, key, str(i))) for i, s in enumerate(node[key])]
        for key in SCHEMA_MAP:
            if isinstance(node.get(key), dict):
                children += [(s, (*path, key, str(k))) for k, s in node[key].items()]
        stack.extend(reversed(children))
    return found


def check_schema(schema: Any) -> None:
    """InvalidRequest naming every keyword of `schema` that cannot be enforced."""
    if not isinstance(schema, dict):
        raise InvalidRequest("json_schema must be a JSON object (a schema such as {\"type\": \"object\", ...}).")
    bad = unsupported(schema)
    if bad:
        shown = "; ".join(bad[:20]) + (f"; and {len(bad) - 20} more" if len(bad) > 20 else "")
        raise InvalidRequest(f"The json_schema uses keywords the answer cannot be held to: {shown}. Remove them "
                             "(or enforce them after the answer); docs/structured-output.md lists what is supported.")


def closed_objects(schema: dict) -> dict:
    """A copy of `schema` where an object schema that lists `properties` and says nothing of other
    properties allows no others, as llama.cpp's converter reads such a schema: a sampled answer
    then ends after the listed properties instead of inventing more until max_tokens cuts it (every
    answer still validates against the original: the copy only narrows it). Not in a schema that
    uses allOf anywhere, where narrowing one branch (or a definition it refers to) could contradict
    another."""
    out = json.loads(json.dumps(schema))
    if '"allOf"' in json.dumps(schema):
        return out
    stack = [out]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("properties"), dict) and not {"additionalProperties", "patternProperties",
                                                             "unevaluatedProperties"} & node.keys():
            node["additionalProperties"] = False
        for key in ONE_SCHEMA:
            stack.append(node.get(key))
        for key in SCHEMA_LIST:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in SCHEMA_MAP:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
    return out


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
#: compilations running or queued at most (beyond it a request is refused at once, not queued)
MAX_PENDING = 8
_pending = threading.BoundedSemaphore(MAX_PENDING)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="a3b-grammar")
        return _pool


def compile_bounded(fn: Callable[[], T], abandoned: threading.Event | None = None,
                    what: str = "grammar") -> T:
    """fn() on the compile threads; its result, or InvalidRequest when it takes longer than
    A3B_GRAMMAR_TIMEOUT_S (the bound named), or Cancelled when `abandoned` is set meanwhile. A
    compilation left running ends by the compiler's own limits; its result is dropped."""
    if not _pending.acquire(blocking=False):
        raise InvalidRequest(f"{MAX_PENDING} grammars are compiling already; try again in a moment.")
    try:
        fut: Future = _executor().submit(fn)
    except BaseException:
        _pending.release()
        raise
    fut.add_done_callback(lambda _: _pending.release())
    limit = timeout_s()
    deadline = time.monotonic() + limit
    while True:
        left = deadline - time.monotonic()
        if abandoned is not None and abandoned.is_set():
            fut.cancel()
            raise Cancelled(f"The request was abandoned while its {what} compiled.")
        if left <= 0:
            fut.cancel()
            raise InvalidRequest(f"The {what} took longer than {limit:g} s to compile (A3B_GRAMMAR_TIMEOUT_S); "
                                 "simplify it.")
        try:
            return fut.result(timeout=min(left, 0.05 if abandoned is not None else left))
        except FutureTimeout:
            continue


__all__ = ["FORMATS", "UNSUPPORTED", "check_schema", "check_size", "closed_objects", "compile_bounded", "max_bytes",
           "timeout_s", "unsupported"]
