"""Giving device memory back without unloading: reload a model with more of it in main memory.

When another user of the card (ComfyUI, before a diffusion model loads) needs device memory that
one of our models holds, the first step is a smaller placement where the engine has one (a
mixture-of-experts model whose experts can move to the CPU): the model is reloaded with the planner
told to leave that many bytes free (`reserve`), from the page cache, and keeps serving. Only when no
smaller placement frees enough does the caller unload it.

The planner reads the bytes to keep free from here (`reserve_bytes`), set for the duration of one
reload, so the engine's load path takes no new parameter and a normal load plans as before.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

from ..engine import engine_for
from ..options import LoadSpec

log = logging.getLogger("a3b.handover")

class _Limits(threading.local):
    reserve: int = 0
    cap: int | None = None


_state = _Limits()


def reserve_bytes() -> int:
    """Bytes of device memory a load in this thread must leave free beside its own margin."""
    return _state.reserve


def cap_bytes() -> int | None:
    """The most device memory a load in this thread may plan for (None: what is free)."""
    return _state.cap


@contextlib.contextmanager
def limits(*, reserve: int = 0, cap: int | None = None):
    old = (reserve_bytes(), cap_bytes())
    _state.reserve, _state.cap = reserve, cap
    try:
        yield
    finally:
        _state.reserve, _state.cap = old


def give_back(rt, spec: LoadSpec, nbytes: int) -> dict | None:
    """Reload `spec` in a placement that holds at least `nbytes` less device memory, when its engine
    has one (`Engine.smaller_placement`); the new placement's figures, or None (nothing reloaded)."""
    m = rt.loaded(spec)
    engine = engine_for(spec.path)
    if m is None:
        return None
    cap = engine.smaller_placement(spec, m.info, nbytes)
    if cap is None:
        return None
    t0 = time.perf_counter()
    rt.unload(spec)
    with limits(cap=cap):
        new = rt.load(spec)
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "cap_bytes": cap, "offload": new.info.offload,
           "gpu_bytes": int(new.info.placement.get("gpu_bytes", 0)), "n_cpu_moe": new.info.n_cpu_moe,
           "n_gpu_layers": new.info.n_gpu_layers}
    log.info("%s: gave device memory back by a smaller placement in %.2f s: %s", new.name, seconds, new.info.offload)
    return out
