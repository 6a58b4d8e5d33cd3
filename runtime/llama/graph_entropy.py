"""The entropy of a row's raw next-token distribution, computed inside llama.cpp's decode graph, where
the logits are, for requests whose tokens a backend chain draws (sampler_choice.py).

On the CPU the entropy is three passes over each n_vocab-float row (rows.py): 2.8 ms for 16 rows of
a 152k vocabulary against a 9 ms decode step on an H200 (a 24% cost at 16 requests). Here it is a
handful of graph operations per row, run by the backend beside the model (on a GPU, kernels in the
same CUDA graph; on the CPU, llama.cpp's compute threads), and only one float per row comes back.

Two stateless samplers frame a request's backend chain: `measure`, first (before ignore_eos's bias
and every sampler that reshapes the row), adds the operations over the raw logits; `deliver`, last
(after `dist`, which sets the probabilities it drew from), puts the entropy where llama.cpp copies a
chain's probabilities to the host, so `llama_get_sampled_probs_ith` of the row is one float, the
entropy. llama.cpp builds a chain's part of the graph row after row, each row's samplers in chain
order, on the thread that called llama_decode, so the tensor `measure` made is handed to `deliver`
through that thread's state. Neither has a state of its own (llama.cpp clones and copies them
without asking), and the CPU path of a chain never sees them (apply does nothing).

The formula is the CPU's: with z = logits - max, p = softmax(z), H = log(sum exp z) - sum(p z), and
log(sum exp z) = -log p[argmax] (the largest probability never underflows).
"""
from __future__ import annotations

import ctypes
import threading
from functools import cache
from types import SimpleNamespace

# Standalone (the vetting child imports it beside itself): the standard library and the llama_cpp
# module it is given, nothing of the package.

_V = ctypes.c_void_p


@cache
def _ops(L) -> SimpleNamespace:
    """ggml's graph functions, looked up through libllama (so in the very libggml-base it uses)."""
    lib = L.llama_cpp._lib

    def fn(name, res, *args):
        return ctypes.CFUNCTYPE(res, *args)((name, lib))

    binary = ("ggml_sub", "ggml_mul", "ggml_add", "ggml_get_rows")
    unary = ("ggml_soft_max", "ggml_sum", "ggml_argmax", "ggml_log", "ggml_neg")
    return SimpleNamespace(**{n: fn(n, _V, _V, _V, _V) for n in binary}, **{n: fn(n, _V, _V, _V) for n in unary},
                           ggml_reshape_1d=fn("ggml_reshape_1d", _V, _V, _V, ctypes.c_int64),
                           ggml_reshape_2d=fn("ggml_reshape_2d", _V, _V, _V, ctypes.c_int64, ctypes.c_int64),
                           ggml_nelements=fn("ggml_nelements", ctypes.c_int64, _V))


def build(g, ctx: int, logits: int) -> int:
    """The graph operations that make a [1] tensor holding the entropy (nats) of softmax(logits)."""
    n = g.ggml_nelements(logits)
    x = g.ggml_reshape_1d(ctx, logits, n)
    top = g.ggml_argmax(ctx, x)                                                  # I32 [1]
    xmax = g.ggml_reshape_1d(ctx, g.ggml_get_rows(ctx, g.ggml_reshape_2d(ctx, x, 1, n), top), 1)
    z = g.ggml_sub(ctx, x, xmax)                                                 # <= 0
    p = g.ggml_soft_max(ctx, z)
    pmax = g.ggml_reshape_1d(ctx, g.ggml_get_rows(ctx, g.ggml_reshape_2d(ctx, p, 1, n), top), 1)
    # H = -log pmax - sum(p z)
    return g.ggml_neg(ctx, g.ggml_add(ctx, g.ggml_log(ctx, pmax), g.ggml_sum(ctx, g.ggml_mul(ctx, p, z))))


class _Handoff(threading.local):
    tensor: int | None = None


_handoff = _Handoff()


@cache
def _interfaces(L) -> tuple:
    """The two sampler interfaces, alive for the process (cached): llama.cpp holds their pointers."""
    g = _ops(L)

    def measure(smpl, ctx, gf, data) -> None:
        _handoff.tensor = build(g, ctx, data.contents.logits)

    def deliver(smpl, ctx, gf, data) -> None:
        t, _handoff.tensor = _handoff.tensor, None
        if t is not None:
            data.contents.probs = t

    def backend_init(smpl, buft, n_outputs_max) -> bool:
        return True

    def cpu_apply(smpl, cur_p) -> None:
        """Nothing on the CPU: a chain drawn on the CPU reads its entropy from the row (rows.py)."""

    def iface(apply):
        i = L.llama_sampler_i()
        i.apply = L.llama_sampler_i_apply(cpu_apply)
        i.backend_init = L.llama_sampler_i_backend_init(backend_init)
        i.backend_apply = L.llama_sampler_i_backend_apply(apply)
        return i

    return iface(measure), iface(deliver)


def taps(L) -> tuple:
    """(measure, deliver): two new samplers, the first and the last of a request's backend chain."""
    return tuple(L.llama_sampler_init(ctypes.byref(i), None) for i in _interfaces(L))


def read(L, ctx, row: int) -> float | None:
    """The entropy `deliver` left for output row `row` of the last decode (None if there is none)."""
    if L.llama_get_sampled_probs_count_ith(ctx, row) != 1:
        return None
    ptr = L.llama_get_sampled_probs_ith(ctx, row)
    return float(ptr[0]) if ptr else None
