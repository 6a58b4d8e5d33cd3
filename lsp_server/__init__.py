"""A3B's language server: inline completions, completions, quick fixes and explanations from the
shared runtime, for VS Code, Neovim and any other LSP client.

Reachable three ways: `a3b lsp --stdio` (an editor starts it), `a3b lsp --tcp HOST:PORT` or
`--ws HOST:PORT` (several editors share one process and one loaded model), and in-process when
ComfyUI loads the pack (see inprocess.py). pygls is imported here and below, never by runtime/.
"""
from __future__ import annotations

import os
import sys

from ..runtime.environment import env
from ..runtime.options import LSP_TOKEN


def main(args) -> int:
    """Entry point of `a3b lsp` (see cli.py for the arguments)."""
    import asyncio

    from .engine import Engine
    from .transport import parse_address, serve_forever, serve_stdio

    token = getattr(args, "token", None) or env(LSP_TOKEN.env)
    model = getattr(args, "model", None)
    if getattr(args, "tcp", None) or getattr(args, "ws", None):
        kind = "tcp" if args.tcp else "ws"
        host, port = parse_address(args.tcp or args.ws)
        if model:
            from ..runtime import get_runtime

            get_runtime().spec(model)  # a clear error now rather than at the first request
        engine = Engine(default_model=model)
        if token is None:
            print("a3b lsp: warning: no --token or A3B_LSP_TOKEN: any local user can use this server.",
                  file=sys.stderr)

        def ready(lst):
            engine.address = lst.address
            print(f"a3b lsp: listening on {lst.address}", file=sys.stderr, flush=True)

        try:
            asyncio.run(serve_forever(engine, kind, host, port, token, ready))
        except KeyboardInterrupt:
            pass
        finally:
            engine.close()
        return 0

    # stdio: the protocol owns the real stdout; anything else printing to fd 1 (a C library, a
    # stray print) goes to stderr instead of corrupting the message stream.
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from .transport import FdReader

    engine = Engine(default_model=model, address="stdio")
    try:
        code = asyncio.run(serve_stdio(engine, FdReader(sys.stdin.fileno()), out))
    except KeyboardInterrupt:
        code = 130
    finally:
        engine.close()
    _leave_promptly(code)
    return code


#: Seconds the stdio server gives its remaining threads to finish once the editor is gone.
EXIT_GRACE_S = 2.0


def _leave_promptly(code: int) -> None:
    """The editor that started this server is gone: its work was cancelled (generations between two
    tokens, embeddings between two packs), so threads end within moments. Should one still be
    inside a long call (a model load, say), the interpreter would wait for it at exit; instead the
    process ends after EXIT_GRACE_S, so a dead editor never leaves a server burning CPU."""
    import threading
    import time

    deadline = time.monotonic() + EXIT_GRACE_S
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    # Always end here, not through the interpreter's teardown: a model's worker thread (a daemon) may
    # still be inside llama.cpp, and finalising the interpreter under it crashed the process (SIGSEGV).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
