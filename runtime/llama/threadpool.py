"""Persistent ggml CPU threadpools attached to a generation context (decode and batch threads).

Without an attached pool, ggml's CPU backend makes a disposable threadpool for every CPU graph
compute. In a build without OpenMP that creates and joins the worker threads each time; with
experts in main memory a token's graph has one CPU split per offloaded layer, so dozens of times per
token. In an OpenMP build (the default one) the threads persist in OpenMP's team anyway and the pool
saves only its allocation per compute. llama.cpp's own tools attach two pools to their context
(common.cpp's threadpools): one for single tokens, one for batches; this module does the same
through ctypes, since llama-cpp-python binds neither llama_attach_threadpool nor ggml_threadpool_*.

With pools attached, llama.cpp computes a single token on the decode pool and any batch of more
than one token on the batch pool, with the thread counts llama_set_n_threads gave; a count above
the pool's size is cut to it (without OpenMP) or overruns the pool's worker array (with OpenMP), so
each pool is used at exactly its size. The thread tuner (threadtune.py) picks the decode threads for
some batches of several one-token decodes, and the batch threads for some single tokens: `use` then
attaches the one pool in the other's place too. Pools are paused while the model is idle (`idle`): a
paused pool's threads wait on a condition variable instead of polling, and the next compute resumes
it. Anything missing from the build (an old library, a CPU backend loaded as a module without these
symbols): no pools, as before.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

from .binding import llama

log = logging.getLogger("a3b.llama")

#: GGML_MAX_N_THREADS in ggml.h: the length of ggml_threadpool_params.cpumask
GGML_MAX_N_THREADS = 512

#: How long a pool's idle threads poll for the next compute before sleeping on a condition variable
#: (without OpenMP only; ggml's level 0-100 is 128k pause instructions per unit). llama.cpp's tools
#: default to 50: tens to hundreds of milliseconds of spinning on every pool thread after each
#: compute. The gaps worth bridging are short: between the CPU splits of one token (the GPU's part
#: of a layer, tens of microseconds) and between tokens (sampling and scheduling, under a
#: millisecond). 10 bridges both on current CPUs and spins a tenth as long when the host (ComfyUI's
#: own work, say) wants the cores; idle pools are paused anyway.
POLL = 10


class ThreadpoolParams(ctypes.Structure):
    """struct ggml_threadpool_params (ggml.h)."""
    _fields_ = [("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),   # all false: the default affinity
                ("n_threads", ctypes.c_int),
                ("prio", ctypes.c_int),                           # enum ggml_sched_priority, 0 = normal
                ("poll", ctypes.c_uint32),
                ("strict_cpu", ctypes.c_bool),
                ("paused", ctypes.c_bool)]


_api = None   # the bound functions, False when the build lacks one
_live: set[int] = set()   # pools made and not freed yet


def live_pools() -> int:
    """Pools alive in this process (each context has one or two until it is freed)."""
    return len(_live)


def _bind():
    """The functions pools need, bound once; None when the build lacks one (logged at debug)."""
    global _api
    if _api is None:
        try:
            from .devices import _ggml

            llama()
            from llama_cpp import llama_cpp as low   # its ctypes handle of libllama

            g, lib = _ggml(), low._lib   # libggml's handle reaches ggml-base's and ggml-cpu's symbols
            g.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(ThreadpoolParams), ctypes.c_int]
            g.ggml_threadpool_params_init.restype = None
            g.ggml_threadpool_new.argtypes = [ctypes.POINTER(ThreadpoolParams)]
            g.ggml_threadpool_new.restype = ctypes.c_void_p
            for fn in ("ggml_threadpool_free", "ggml_threadpool_pause", "ggml_threadpool_resume"):
                getattr(g, fn).argtypes = [ctypes.c_void_p]
                getattr(g, fn).restype = None
            lib.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.llama_attach_threadpool.restype = None
            _api = (g, lib)
        except (AttributeError, OSError) as e:
            log.debug("no ggml threadpools in this llama.cpp build (%s): each compute makes its own", e)
            _api = False
    return _api or None


def params(n_threads: int, paused: bool = False) -> ThreadpoolParams:
    """ggml's defaults for `n_threads` threads (normal priority, no affinity), polling at POLL."""
    p = ThreadpoolParams()
    api = _bind()
    if api:
        api[0].ggml_threadpool_params_init(ctypes.byref(p), n_threads)
    else:
        p.n_threads = n_threads
    p.poll, p.paused = POLL, paused
    return p


class Pools:
    """The decode pool and, when the batch threads differ, the batch pool of one context."""

    def __init__(self, api, ctx, decode: int, batch: int):
        self._g, self._lib, self.ctx = api[0], api[1], ctx
        self.sizes = (decode, batch)
        self.decode = self._g.ggml_threadpool_new(ctypes.byref(params(decode, paused=batch != decode)))
        self.batch = self._g.ggml_threadpool_new(ctypes.byref(params(batch))) if batch != decode else self.decode
        _live.update(tp for tp in (self.decode, self.batch) if tp)
        if not self.decode or not self.batch:
            self.free()   # nothing was attached yet
            raise OSError(f"ggml_threadpool_new failed for {decode} / {batch} threads")
        self.batch_threads = batch
        self.single_threads = decode
        self._lib.llama_attach_threadpool(ctx, self.decode, self.batch)

    def use(self, batch_threads: int, single_threads: int | None = None) -> None:
        """Batches of several tokens run on `batch_threads`, a single token on `single_threads`
        (default: as now): each on the batch pool or the decode pool, the one of that size."""
        single = self.single_threads if single_threads is None else single_threads
        if (batch_threads, single) != (self.batch_threads, self.single_threads):
            pool = {self.sizes[0]: self.decode, self.sizes[1]: self.batch}
            self._lib.llama_attach_threadpool(self.ctx, pool[single], pool[batch_threads])
            self.batch_threads, self.single_threads = batch_threads, single

    def idle(self) -> None:
        """Put the threads to sleep until the next compute (which resumes its pool)."""
        for tp in {self.decode, self.batch} - {None}:
            self._g.ggml_threadpool_pause(tp)

    def free(self) -> None:
        """Free the pools, after llama_free of their context: the context's CPU backend keeps a pointer
        to the last pool it ran on and pauses it when it switches pools, so a pool freed before its
        context would be touched after its end."""
        for tp in {self.decode, self.batch} - {None}:
            self._g.ggml_threadpool_free(tp)
            _live.discard(tp)
        self.decode = self.batch = self.ctx = None


def attach(ctx, decode: int, batch: int) -> Pools | None:
    """Pools of `decode` and `batch` threads attached to `ctx`, or None where the build has none."""
    api = _bind()
    if api is None:
        return None
    try:
        return Pools(api, ctx, decode, batch)
    except OSError as e:
        log.debug("%s: each compute makes its own threadpool", e)
        return None


#: OpenMP runtimes llama.cpp's CPU backend links (GCC's, LLVM's)
OPENMP_LIBS = ("libgomp.so.1", "libomp.so", "libomp.so.5")


def release_openmp_threads() -> bool:
    """Free the OpenMP threads the calling thread started, where an OpenMP runtime is loaded (its
    `omp_pause_resource_all`); True when one was paused.

    Called on the thread that loaded a model, after the load. On a CPU with AMX, llama.cpp converts
    the weights at load time in an OpenMP parallel region of all the cores, so the loading thread keeps
    a team of idle threads; the worker thread that decodes starts a team of its own. With more OpenMP
    threads than cores libgomp spins only a hundred rounds at a barrier before it sleeps on a futex, and
    a graph has a barrier after every operation. llama-server loads and decodes on one thread. On an
    AMX host pinned to two cores, one request decoded at 74 tokens/s with the load's threads kept and
    108 with them released (bench/bench_openmp_team.py; llama-server 89 on that file)."""
    if not sys.platform.startswith("linux"):
        return False
    for name in OPENMP_LIBS:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)   # only one that is loaded already
            fn = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn(1) == 0   # omp_pause_soft
    return False
