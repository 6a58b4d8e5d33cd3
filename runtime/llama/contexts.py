"""llama_context_params for a LoadSpec: the generation context (one KV sequence per slot) and the
embedding contexts (one per pooling type), with the thread counts both use."""
from __future__ import annotations

from ..environment import usable_cpus
from ..options import LoadSpec, state_snapshots
from .binding import GGML_TYPES, llama


#: Texts are packed into one embedding decode up to this many tokens. llama.cpp computes a logits
#: row for every output token of a pooled batch (n_vocab floats each: 192 KB for the default model),
#: so the pack size, not the context, decides the memory an embedding pack touches.
EMBED_PACK_TOKENS = 32
EMBED_PACK_TEXTS = 8


def thread_counts(n_threads: int = 0) -> tuple[int, int]:
    """(decode threads, prompt threads). 0 = automatic: half the cores for decoding, all for prompts.

    Decoding one token is memory-bound and its threads meet at a barrier after every operation: on
    a busy machine a descheduled thread stalls the others (measured on 2 shared cores: 2 decode
    threads gave 11-60 tokens/s, 1 thread 78-81). Prompt processing is compute-bound and uses all
    cores. This matches llama-cpp-python's own defaults.
    """
    if n_threads > 0:
        return n_threads, n_threads
    cores = usable_cpus()
    return max(1, cores // 2), cores


def context_params(spec: LoadSpec, *, embeddings: bool = False, pooling: str = "mean"):
    """llama_context_params for the generation context of `spec`, or one of its embedding contexts."""
    L = llama()
    p = L.llama_context_default_params()
    p.n_threads, p.n_threads_batch = thread_counts(spec.n_threads)
    if embeddings:
        # Pooling happens inside llama.cpp (pooling != NONE), so only one vector per text leaves the
        # graph. A text must fit one micro-batch for pooling, so ubatch = context. Kept small by
        # default (LoadSpec.embed_n_ctx): llama.cpp clears the whole KV buffer at creation, so
        # every cell costs memory at once (256 tokens: 6 MB for the default model).
        p.n_ctx = p.n_batch = p.n_ubatch = spec.embed_n_ctx
        p.n_seq_max = EMBED_PACK_TEXTS
        p.embeddings = True
        p.pooling_type = {"mean": L.LLAMA_POOLING_TYPE_MEAN, "cls": L.LLAMA_POOLING_TYPE_CLS,
                          "last": L.LLAMA_POOLING_TYPE_LAST}[pooling]
        p.kv_unified = True
    else:
        p.n_ctx = spec.n_ctx * spec.n_parallel
        p.n_batch = max(spec.n_batch, spec.n_parallel)
        p.n_ubatch = p.n_batch
        p.n_seq_max = spec.n_parallel
        # unified=False gives every sequence exactly n_ctx cells of its own
        p.kv_unified = spec.n_parallel == 1
        # rejected drafts leave the cache; a recurrent layer (qwen35's Gated DeltaNet) can only step
        # back by a snapshot per token, so it keeps as many as a step drafts (llama.cpp sets 0 for
        # architectures without such layers). Each snapshot is a copy of every recurrent layer's
        # state per sequence (tens of MB at 30B scale), so only speculation asked for by name pays
        # it; "auto" does not speculate on such a model (drafting.py).
        p.n_rs_seq = state_snapshots(spec.speculative, spec.draft_max)
        if spec.backend_sampling != "off":
            # llama.cpp refuses a batch (decode -1) where a sequence with a backend chain has more
            # output rows than this (default 1); a speculating request asks for its last token's
            # row and one per drafted token
            p.n_outputs_max_per_seq = spec.draft_max + 1
    p.flash_attn_type = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                         "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}[spec.flash_attn]
    p.type_k = p.type_v = GGML_TYPES[spec.kv_cache_type]
    p.no_perf = True
    return p
