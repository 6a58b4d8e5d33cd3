"""A request's llama.cpp sampler chain, from its SamplingParams.

The default order is top-k, the repeat penalty, top-p, min-p, temperature, then a seeded draw
(top-k first when it is on: the penalty sampler is slow over the whole vocabulary); at temperature 0
the chain is the penalty and the likeliest token. A request may give llama-server's `samplers`
order instead (llama.vim sends top_k, top_p, infill): the samplers named apply in that order, those
left out not at all (without `temperature` the draw is at temperature 1, as llama-server draws), and
`infill` is llama.cpp's fill-in-the-middle sampler. `ignore_eos` puts a bias of -inf on every
end-of-generation token first, as llama-server does. A backend chain that measures entropies has
graph_entropy's two taps around all of that (the first sees the raw row).
"""
from __future__ import annotations

from ..options import SAMPLER_NAMES
from .binding import llama

#: the order when a request gives none
DEFAULT_ORDER = SAMPLER_NAMES[:5]


def greedy(sp) -> bool:
    """Whether the chain is the likeliest token alone (the worker takes an argmax of the row instead)."""
    return sp.temperature <= 0 and sp.repeat_penalty == 1.0 and sp.samplers is None


def _order(sp) -> tuple[str, ...]:
    return DEFAULT_ORDER if sp.samplers is None else tuple(sp.samplers)


def cold(sp) -> bool:
    """Whether the chain ends with the likeliest token rather than a seeded draw."""
    return sp.temperature <= 0 and "temperature" in _order(sp)


def applied(sp) -> list[str]:
    """The names of the samplers the chain applies to a row, in order (before its draw)."""
    hot = not cold(sp)
    # the default chain at temperature 0 keeps the penalty alone before the likeliest token
    shaping = sp.samplers is not None or hot
    applies = {"top_k": sp.top_k > 0 and shaping, "penalties": sp.repeat_penalty != 1.0,
               "top_p": sp.top_p < 1.0 and shaping, "min_p": sp.min_p > 0 and shaping,
               "temperature": hot, "infill": True}
    return [name for name in _order(sp) if applies[name]]


def candidates(sp) -> int:
    """How many of a row's likeliest tokens the chain's answer can come from, or 0 where it may come
    from anywhere in the row: then a set of candidates that holds the row's top that many is all the
    chain needs (rows.draw).

    A chain that starts with top-k needs the top k. A repeat penalty above 1 before it (a sampler
    order that puts `penalties` first), or before the likeliest token at temperature 0 (the default
    chain there), only lowers the logits of the at most repeat_last_n distinct tokens it saw, so the
    top k after it (the likeliest one: k = 1) lie among the row's top k + repeat_last_n: each of them
    has above it in the row only tokens still above it after the penalty (fewer than k) and lowered
    tokens. A penalty below 1 raises tokens from anywhere in the row. The ignore_eos bias does not
    count: the backend asks for one more candidate per banned token, and the chain's bias sinks them."""
    names = applied(sp)
    lowered = 0
    if names[:1] == ["penalties"]:
        if sp.repeat_penalty < 1.0 or sp.repeat_last_n <= 0:
            return 0
        lowered, names = sp.repeat_last_n, names[1:]
    if names[:1] == ["top_k"]:
        return sp.top_k + lowered
    return 1 + lowered if lowered and not names and cold(sp) else 0


def build(sp, seed: int, n_vocab: int, vocab_ptr, eog: list[int], taps: tuple | None = None):
    L = llama()
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())

    def add(s):
        L.llama_sampler_chain_add(chain, s)

    if taps:
        add(taps[0])
    if sp.ignore_eos:
        bias = (L.llama_logit_bias * len(eog))(*(L.llama_logit_bias(t, float("-inf")) for t in eog))
        add(L.llama_sampler_init_logit_bias(n_vocab, len(eog), bias))
    for name in applied(sp):
        if name == "top_k":
            add(L.llama_sampler_init_top_k(sp.top_k))
        elif name == "penalties":
            add(L.llama_sampler_init_penalties(n_vocab, sp.repeat_last_n, sp.repeat_penalty, 0.0, 0.0))
        elif name == "top_p":
            add(L.llama_sampler_init_top_p(sp.top_p, 1))
        elif name == "min_p":
            add(L.llama_sampler_init_min_p(sp.min_p, 1))
        elif name == "temperature":
            add(L.llama_sampler_init_temp(sp.temperature))
        elif name == "infill":
            add(L.llama_sampler_init_infill(vocab_ptr))
    add(L.llama_sampler_init_greedy() if cold(sp) else L.llama_sampler_init_dist(seed))
    if taps:
        add(taps[1])
    return chain
