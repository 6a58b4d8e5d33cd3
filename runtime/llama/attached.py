"""A request's sampler, and the backend chains attached to the generation context's sequences.

A backend chain is attached to one sequence (`llama_set_sampler`), and llama.cpp then draws that
sequence's tokens inside the decode (sampler_choice.py says which requests get one). Attaching a
chain, replacing it or taking it off marks llama.cpp's scheduler for a rebuild: before the next
decode it builds its scheduler and reserves its graphs again. On one H200 (random Qwen3-8B) requests
at the language server's sampling (temperature 0.25, seed 0, confidence spans, so a backend chain)
waited 23-31 ms for their first token against 8-16 ms for the same requests without spans: two
rebuilds each, one when the chain came and one when it went.

So the chain of the request that finished last stays on its sequence, parked, and the next request
placed there with the same settings and seed takes it over, reset to the state a fresh chain of that
seed has (`llama_sampler_reset` reseeds its draw): an editor asking again and again about one file
(whose prompts share their start, so they keep their slot) pays no rebuild. One chain at most is
parked: parking several was measured slower, since requests whose prompts share little rotate over
the free slots and chains piled up on many sequences. A parked chain leaves when another is parked
or attached on its sequence, or before a decode gives its sequence an output row that is not its
owner's (a CPU-sampled request placed there, whose row must come back as logits); each of those
costs the one rebuild that taking it off at its request's end cost before.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .binding import llama

if TYPE_CHECKING:  # pragma: no cover
    from .grammar import Grammar


@dataclass(eq=False)
class Sampler:
    """A request's llama.cpp sampler chain; `greedy` when the chain is the greedy sampler alone;
    `grammar` when the answer is constrained (grammar.py); `seq_id` when the chain is attached to
    that sequence of the context as a backend chain (drawn inside the decode; sampler_choice.py)."""
    chain: Any
    greedy: bool = False
    grammar: Grammar | None = None
    seq_id: int | None = None
    #: token ids never drawn (ignore_eos: the end-of-generation tokens; the chain holds them too)
    ban: list[int] = field(default_factory=list)
    #: the backend chain measures its row's entropy in the graph (graph_entropy.py)
    entropy: bool = False
    #: what made a backend chain (settings, seed, entropy taps): a parked chain goes to an equal key
    key: Any = None
    #: k where a CPU chain's answer comes from the row's top k (chain.candidates; rows.draw gives it
    #: only those), 0 where it reads the whole row
    candidates: int = 0

    @property
    def backend(self) -> bool:
        return self.seq_id is not None


class AttachedChains:
    """The backend chains of one context by sequence, and the one parked chain; only the worker
    thread calls it."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.by_seq: dict[int, Sampler] = {}
        self.parked: Sampler | None = None

    def attach(self, sampler: Sampler, seq_id: int) -> bool:
        """Attach `sampler`'s chain to `seq_id` (replacing what was there); False where llama.cpp
        refuses it (then nothing is attached there)."""
        other = self.by_seq.pop(seq_id, None)
        if other is not None and other is not sampler:
            other.seq_id = None   # replaced below: prepare() attaches a live one again where it goes next
        ok = llama().llama_set_sampler(self.ctx, seq_id, sampler.chain)
        if other is not None and other is self.parked:
            self._free_parked()   # nobody owns it
        if not ok:
            return False
        self.by_seq[seq_id] = sampler
        sampler.seq_id = seq_id
        return True

    def detach(self, sampler: Sampler) -> None:
        seq = sampler.seq_id
        if seq is not None and self.by_seq.get(seq) is sampler:
            llama().llama_set_sampler(self.ctx, seq, None)   # before the chain is freed
            del self.by_seq[seq]
        sampler.seq_id = None

    def holds(self, sampler: Sampler, seq_id: int) -> bool:
        return sampler.seq_id == seq_id and self.by_seq.get(seq_id) is sampler

    def park(self, sampler: Sampler) -> bool:
        """A finished request's chain stays on its sequence for the next request with its key (the
        one parked before it comes off)."""
        if sampler.key is None or sampler.grammar is not None or not self.holds(sampler, sampler.seq_id):
            return False
        if self.parked is not None:
            self.detach(self.parked)
            self._free_parked()
        self.parked = sampler
        return True

    def take(self, seq_id: int, key: Any) -> Sampler | None:
        """The chain parked on `seq_id` with `key`, reset to a fresh chain's state, or None."""
        held = self.parked
        if held is None or held.seq_id != seq_id or held.key != key:
            return None
        llama().llama_sampler_reset(held.chain)
        self.parked = None
        return held

    def clear_for(self, seq_id: int, owner: Sampler | None) -> None:
        """Before a decode with an output row of `seq_id` sampled by `owner`: a chain there that is
        not `owner`'s comes off (the parked one is freed; a live one's request attaches it again where
        it decodes next)."""
        held = self.by_seq.get(seq_id)
        if held is None or held is owner:
            return
        self.detach(held)
        if held is self.parked:
            self._free_parked()

    def close(self) -> None:
        """After the context is freed: the parked chain (its request is gone)."""
        if self.parked is not None:
            self._free_parked()
        self.by_seq.clear()

    def _free_parked(self) -> None:
        s, self.parked = self.parked, None
        s.seq_id = None
        if s.chain:
            llama().llama_sampler_free(s.chain)
            s.chain = None
