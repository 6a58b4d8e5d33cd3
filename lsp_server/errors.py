"""How runtime and document errors reach the editor: as LSP error responses.

A document error (a URI that is not open, a position outside the document) is the client's: it
becomes Invalid params. Any other A3B error becomes RequestFailed with its message unchanged and
its code in `data`; a cancelled generation becomes RequestCancelled.
"""
from __future__ import annotations

import functools

from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams, JsonRpcRequestCancelled

from ..runtime.errors import A3BError, Cancelled
from .documents import DocumentError

REQUEST_FAILED = -32803


class RequestFailed(JsonRpcException):
    """An A3B error as an LSP error response (RequestFailed), message unchanged."""

    CODE = REQUEST_FAILED


def lsp_error(e: Exception) -> JsonRpcException:
    if isinstance(e, DocumentError):
        return JsonRpcInvalidParams(str(e))
    return RequestFailed(str(e), data={"code": getattr(e, "code", type(e).__name__)})


def _guard(coro_fn):
    """Turn runtime and document errors into clear LSP error responses."""

    @functools.wraps(coro_fn)
    async def wrapped(*args, **kwargs):
        try:
            return await coro_fn(*args, **kwargs)
        except Cancelled as e:
            raise JsonRpcRequestCancelled(str(e)) from e
        except (DocumentError, A3BError) as e:
            raise lsp_error(e) from e
    return wrapped
