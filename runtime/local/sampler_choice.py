"""Which sampler draws a request's tokens: llama.cpp's backend chain (inside the compute graph, on
the GPU where the model runs there) or the CPU chain.

llama.cpp (0.3.36's vendored copy) has graph implementations of greedy, dist, top-k, top-p, min-p
and temperature. A sequence with a backend chain gets its token drawn in the decode itself; only the
token (and the chain's truncated logits and probabilities) comes back, so the CPU never copies and
sorts a whole vocabulary row for it. What the backend chain cannot give decides the rest:

* a grammar (json_schema, grammar) is matched on the CPU (llguidance's matcher): CPU only;
* a repeat penalty stays on the CPU (its place in the chain, after top-k, is what today's output is
  made of; the graph version would change the order and so the text), and so does a sampler order
  given by the request (llama-server's `samplers`: the infill sampler has no graph version);
* logprobs read the raw logits row, which llama.cpp does not copy back for an output row whose
  sequence has a backend chain (and whose logits the chain transforms in place); confidence spans
  need only the row's entropy, which a backend chain measures in the graph where the build's probe
  found that it matches the CPU's (llama/graph_entropy.py), else they keep the CPU chain;
* speculative drafts need one output row per drafted token, which the context is made for up to
  the model's draft_max (a request asking more keeps the CPU chain); then the worker accepts a
  drafted token while the row's draw equals it, and the backend draws one token per output row,
  its random stream advancing only for the tokens accepted (llama.cpp's `dist` is transactional
  with more than one output row per sequence), so seeded output stays reproducible and draft rows
  stay on the backend.

Which of the rest the graph draws is the mode: `auto` (the default) the requests with confidence
spans, where the graph saves the CPU's pass over every row; `on` also greedy requests and temperature
chains, which the CPU drew faster in every measurement (choose says where); `off` none.

`choose` is pure: the worker asks it once per request and records the answer in the result
(`GenerationResult.sampler`) and the model's status counters.
"""
from __future__ import annotations

from ..options import BACKEND_SAMPLING_MODES

BACKEND = "backend"
CPU = "cpu"


def cpu_reasons(request, entropy: bool = False) -> list[str]:
    """Why `request` (a GenerationRequest) needs the CPU chain; empty when the backend can draw it
    (and, with `entropy`, measure each row's entropy)."""
    sp = request.sampling
    why = []
    if sp.repeat_penalty != 1.0:
        why.append("repeat_penalty")
    if sp.samplers is not None:
        why.append("samplers")   # llama-server's order, and its infill sampler, run on the CPU
    if request.json_schema is not None or request.grammar is not None:
        why.append("grammar")
    if request.logprobs is not None:
        why.append("logprobs")
    if request.confidence.enabled and not entropy:
        why.append("confidence")
    return why


def choose(mode: str, available: bool, request, draft_max: int | None = None,
           entropy: bool = False) -> tuple[str, str]:
    """(BACKEND or CPU, the reason in a few words) for `request` on a model loaded with
    backend_sampling=`mode` (and `draft_max`), where `available` says whether this build and
    placement can run backend chains at all and `entropy` whether they measure entropies too
    (probed once, vet.backend_sampling_works).

    The context takes draft_max + 1 output rows per sequence with a backend chain (llama.cpp refuses
    a batch with more), so a request that asks to draft more than the model was loaded with keeps
    the CPU chain and drafts what it asked."""
    if mode not in BACKEND_SAMPLING_MODES:
        raise ValueError(f"backend_sampling {mode!r}")
    if mode == "off":
        return CPU, "backend_sampling=off"
    if not available:
        return CPU, "not available with this build or placement"
    why = cpu_reasons(request, entropy)
    if draft_max is not None and (request.draft_max or 0) > draft_max:
        why.append(f"draft_max above the model's {draft_max}")
    if why:
        return CPU, "needs " + ", ".join(why)
    if mode == "auto" and not request.confidence.enabled:
        # A temperature chain in the graph (a top-k over the whole row, a softmax and a cumulative sum
        # per row, each row its own kernels) was slower than the CPU chains drawn side by side in the
        # sampling threads: 16 streaming clients on an H200, Qwen3-8B shape, 1293 and 1274 tokens/s
        # against 1440 and 1410; on 2 CPU cores, 1 and 4 clients, 115 / 174 against 141 / 203.
        # A greedy row is an argmax over the logits on the CPU, and the graph's greedy sampler lost
        # too (424 / 844 / 1468 tokens/s at 1 / 4 / 16 clients against 494 / 883 / 1640): a chain
        # attached to a sequence, or taken off it, makes llama.cpp build its scheduler and reserve
        # its graphs again before the next decode (llama_set_sampler), so every request that came
        # and went paid that in the time to its first token (16 greedy clients: p50 142 ms against
        # 96 sampled on the CPU). With confidence spans the graph measures the entropy too, which
        # costs the CPU far more than that.
        what = "a greedy row" if request.sampling.temperature <= 0 else "a temperature chain"
        return CPU, f"{what} draws faster on the CPU (backend_sampling=on draws it in the graph)"
    if request.sampling.temperature <= 0:
        return BACKEND, "greedy"
    return BACKEND, "temperature/top-k/top-p/min-p chain"
