"""How `a3b serve` reads a request's JSON body, bounded in size (the fields in it are read by
serve/protocol/ for the OpenAI endpoints, ollama_protocol.py for Ollama's)."""
from __future__ import annotations

import json

from starlette.requests import Request

from ..runtime.errors import InvalidRequest

#: Largest request body read (a chat with a long context is well below it).
MAX_BODY = 16 << 20


async def read_json(request: Request) -> dict:
    size = int(request.headers.get("content-length") or 0)
    if size > MAX_BODY:
        raise InvalidRequest(f"The request body is {size} bytes; at most {MAX_BODY} are read.")
    chunks, n = [], 0   # joined once: growing one bytes object copies it at every chunk
    async for chunk in request.stream():
        chunks.append(chunk)
        n += len(chunk)
        if n > MAX_BODY:
            raise InvalidRequest(f"The request body is larger than {MAX_BODY} bytes.")
    raw = b"".join(chunks)
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"The request body is not JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("The request body is nested too deeply to read.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


__all__ = ["MAX_BODY", "read_json"]
