"""Serving copies: re-encode a model once into a format that processes prompts faster (LoadSpec.serve_as).

Every cold editor request processes its whole context, so prompt (prefill) speed decides editor
latency. For small models stored in Q4_1, as the embedded default is, llama.cpp's CPU kernels are
markedly faster on Q8_0: the same weights re-encoded (dequantise, then `llama_model_quantize`) gave
about 2x the prefill speed with held-out perplexity within 0.2% of the shipped file, at 145 MB
instead of 98 MB. So the runtime can serve such a re-encoded copy:

- `serve_as="as-is"` (default): the file as given.
- `serve_as="q8_0"` (or another llama.cpp type name): the re-encoded copy, made once and cached.
- `serve_as="auto"`: measure prompt speed of both on this machine once (cached with the copy) and
  serve whichever is faster.

Copies live in `options.cache_root()/serving` (`$A3B_CACHE`, default `~/.cache/comfyui-a3b`), keyed
by the source file's path, size and mtime, written under a temporary name and renamed, so an
interrupted run leaves nothing half-written under the final name.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from ..errors import InvalidRequest
from ..options import SERVE_AS, SERVE_FORMATS, LoadSpec, cache_root
from .contexts import context_params
from .binding import fill_batch, llama, sequence
from .quantize import quantize_file
from .weights import Weights

log = logging.getLogger("a3b.serving")

#: llama.cpp LLAMA_FTYPE values of the formats options.SERVE_FORMATS names.
FTYPES = {"q8_0": 7, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q4_k_m": 15, "q6_k": 18}
assert tuple(FTYPES) == SERVE_FORMATS, "every serving format needs its LLAMA_FTYPE here"
_lock = threading.Lock()


def cache_dir() -> Path:
    d = cache_root() / "serving"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _key(src: Path) -> str:
    st = src.stat()
    return hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]


def reencode(src: str | os.PathLike, fmt: str = "q8_0") -> Path:
    """The cached re-encoded copy of `src` in `fmt`, made now if missing."""
    if fmt not in FTYPES:
        raise InvalidRequest(f"Unknown serving format {fmt!r}; choose one of {', '.join(SERVE_AS)}")
    src = Path(src)
    out = cache_dir() / f"{src.stem}.{_key(src)}.{fmt}.gguf"
    if out.is_file():
        return out
    with _lock:
        if out.is_file():
            return out
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        t0 = time.perf_counter()
        try:
            quantize_file(src, tmp, FTYPES[fmt], requantize=True)  # dequantise the source's blocks, then quantise
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        log.info("re-encoded %s as %s in %.1f s", src.name, fmt, time.perf_counter() - t0)
    return out


def _prefill_speed(path: Path, n_tokens: int = 256) -> float:
    """Prompt tokens per second of `path` on this machine (a short, fixed prompt; median of 3)."""
    L = llama()
    w = Weights(path)
    try:
        spec = LoadSpec(path=str(path), n_ctx=n_tokens, n_parallel=1, n_batch=n_tokens)
        ctx = L.llama_init_from_model(w.ptr, context_params(spec))
        try:
            toks = (w.tokenize("def f(x):\n    return x * 2\n" * 40))[:n_tokens]
            batch = L.llama_batch_init(len(toks), 0, 1)
            times = []
            for _ in range(3):
                fill_batch(batch, sequence(toks))
                L.llama_memory_clear(L.llama_get_memory(ctx), True)
                t0 = time.perf_counter()
                L.llama_decode(ctx, batch)
                times.append(time.perf_counter() - t0)
            L.llama_batch_free(batch)
            return len(toks) / sorted(times)[1]
        finally:
            L.llama_free(ctx)
    finally:
        w.free()


def choose(src: str | os.PathLike, candidate: str = "q8_0") -> Path:
    """`serve_as="auto"`: the faster of the source and its `candidate` copy at prompt processing."""
    src = Path(src)
    choice_file = cache_dir() / f"{src.stem}.{_key(src)}.choice.json"
    if choice_file.is_file():
        data = json.loads(choice_file.read_text())
        chosen = Path(data["path"])
        if chosen.is_file():
            return chosen
    copy = reencode(src, candidate)
    speeds = {"as-is": _prefill_speed(src), candidate: _prefill_speed(copy)}
    best = max(speeds, key=speeds.get)
    chosen = src if best == "as-is" else copy
    log.info("serving format for %s: %s (prompt tokens/s: %s)", src.name, best,
             ", ".join(f"{k} {v:.0f}" for k, v in speeds.items()))
    tmp = choice_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"path": str(chosen), "format": best, "prefill_tokens_per_s": speeds}))
    os.replace(tmp, choice_file)
    return chosen


def serving_path(src: str | os.PathLike, serve_as: str) -> Path:
    if serve_as not in SERVE_AS:
        raise InvalidRequest(f"Unknown serve_as {serve_as!r}; choose one of {', '.join(SERVE_AS)}")
    if serve_as == "as-is":
        return Path(src)
    if serve_as == "auto":
        return choose(src)
    return reencode(src, serve_as)
