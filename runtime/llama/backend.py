"""The Backend of the in-process engine over one llama_model for one LoadSpec: the generation
context (one KV sequence per slot, contexts.py), samplers, and the decode and sample calls the model
worker makes; embeddings go to the embedding contexts it holds (embedctx.py). Only the worker
thread calls a backend.
"""
from __future__ import annotations

import ctypes
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..models import vet
from ..models.adapters import check as check_adapter
from ..local.seam import Backend, DecodeAborted, DecodeFailed
from ..environment import env_number, usable_cpus
from ..errors import ModelLoadFailed
from ..grammars import check_size, compile_bounded
from ..options import LoadSpec, parse_speculative
from ..local.scheduler import DecodeStep
from . import abort, chain as chains, graph_entropy, passes
from .attached import AttachedChains, Sampler
from .chain import greedy as chain_greedy
from .binding import fill_batch, llama, log_mark, log_since
from .contexts import EMBED_PACK_TEXTS, EMBED_PACK_TOKENS, context_params, thread_counts
from .embedctx import EmbeddingContexts
from .fitting import kv_stream_bytes, measure_context
from .grammar import Grammar, compile_matcher
from .mtp import MtpContext
from .rows import THREADS_FROM, draw, entropy, heavy, top_candidates
from .sampling_power import backend_powers
from .threadpool import attach
from .threadtune import ThreadTuner
from .weights import Weights

log = logging.getLogger("a3b.llama")

#: Rows are sampled in parallel threads (rows.py) for vocabularies at least this large (a row of a
#: small vocabulary samples faster than a thread hand-off); A3B_SAMPLE_THREADS=0 turns it off.
SAMPLE_THREADS_MIN_VOCAB = 32000


def sample_threads() -> int:
    """Threads that sample the rows of one decode step: A3B_SAMPLE_THREADS, else the cores, at most 16."""
    n = env_number("A3B_SAMPLE_THREADS", int)
    return min(16, usable_cpus()) if n is None else n


class LlamaBackend(Backend):
    def __init__(self, weights: Weights, spec: LoadSpec):
        if spec.lora_path:
            # an adapter made for another base is refused before llama.cpp reads it; the base is the
            # file asked for (a serving copy re-encoded from it carries the same weights)
            check_adapter(spec.lora_path, spec.path)
            # then tried over the base in a child: llama.cpp aborts the process on some malformed adapters
            vet.check_adapter(spec.lora_path, spec.path)
        L = llama()
        self.weights = weights
        self.spec = spec
        self.name = weights.info.name
        mark = log_mark()
        params = context_params(spec)
        #: llama.cpp's passes per decode (A3B_COUNT_PASSES), else None
        self.passes = passes.counter()
        if self.passes is not None:
            self.passes.attach(params)
        with weights.use():
            self.ctx = measure_context(weights, lambda: L.llama_init_from_model(weights.ptr, params))
        self.threads = thread_counts(spec.n_threads)
        self._single_threads, self._batch_threads = self.threads
        self.tuner = ThreadTuner(*self.threads)
        if not self.ctx:
            detail = [ln.strip() for ln in log_since(mark).splitlines()
                      if "error" in ln.lower() or "fail" in ln.lower()]
            raise ModelLoadFailed(f"llama.cpp could not create a context (n_ctx={spec.n_ctx} x "
                                  f"{spec.n_parallel}, kv={spec.kv_cache_type}, flash_attn={spec.flash_attn}): "
                                  f"{' | '.join(detail[-2:]) or 'no detail'}. "
                                  "Try a smaller n_ctx, or kv_cache_type f16.")
        self.pools = attach(self.ctx, *self.threads)   # None: each compute makes its own threadpool
        #: stops a decode from another thread (interrupt); None: decodes always run to their end
        self.abort = abort.flag()
        if self.abort is not None:
            self.abort.attach(self.ctx)
        #: the multi-token-prediction context beside it (speculative=mtp), or None
        self.mtp = MtpContext(weights, self.ctx, context_params(spec)) \
            if parse_speculative(spec.speculative)[0] == "mtp" and weights.n_layer_nextn > 0 else None
        self.mem = L.llama_get_memory(self.ctx)
        if spec.lora_path:
            adapters = (L.llama_adapter_lora_p_ctypes * 1)(weights.adapter(spec.lora_path))
            scales = (ctypes.c_float * 1)(spec.lora_scale)
            L.llama_set_adapters_lora(self.ctx, adapters, 1, scales)
        self.n_ctx_seq = spec.n_ctx
        #: a recurrent model's cache steps back only by the snapshots it keeps (scheduler.py)
        recurrent = L.llama_model_is_recurrent(weights.ptr) or L.llama_model_is_hybrid(weights.ptr)
        self.max_rollback = int(L.llama_n_rs_seq(self.ctx)) if recurrent else None
        #: a slot's cache can be copied into another (the policy closes holes between running slots,
        #: slots.py): one KV stream per slot, no MTP cache mirroring the slots, no recurrent state,
        #: and a copy that costs less than the pass through the weights it saves
        self.can_move = (spec.n_parallel > 1 and self.mtp is None and not recurrent
                         and kv_stream_bytes(weights, spec) <= weights.size_bytes)
        #: backend chains may be attached (sampler_choice.py), measuring entropies in the graph
        #: too (graph_entropy.py); the chains attached to its sequences (attached.py)
        self.backend_sampling, self.backend_entropy = backend_powers(weights, spec)
        self.chains = AttachedChains(self.ctx)
        self.batch = L.llama_batch_init(max(spec.n_batch, spec.n_parallel), 0, 1)
        self.embed_contexts = EmbeddingContexts(weights, spec)
        # a pack never exceeds the embedding context (a single text may fill it)
        self.embed_pack_tokens = min(EMBED_PACK_TOKENS, spec.embed_n_ctx)
        self.embed_pack_texts = EMBED_PACK_TEXTS
        threads = sample_threads()
        self._pool = (ThreadPoolExecutor(max_workers=min(threads, spec.n_parallel),
                                         thread_name_prefix=f"a3b-sample-{self.name}")
                      if threads > 1 and spec.n_parallel >= THREADS_FROM
                      and weights.n_vocab >= SAMPLE_THREADS_MIN_VOCAB else None)

    # -- generation ---------------------------------------------------------------------------
    def interrupt(self, on: bool) -> None:
        if self.abort is not None:
            self.abort.set() if on else self.abort.clear()

    def _aborted(self, step: DecodeStep) -> DecodeAborted:
        """After a decode stopped by `interrupt`: the step's cells leave every sequence it touched."""
        for e in step.entries:
            self.trim(e.job.slot.seq_id, e.position)
        return DecodeAborted("the decode was interrupted")

    def move(self, src: int, dst: int) -> None:
        """Copy sequence `src`'s KV stream into `dst`'s (llama.cpp copies the whole stream before the
        next decode; `src` keeps its own)."""
        L = llama()
        L.llama_memory_seq_rm(self.mem, dst, -1, -1)
        L.llama_memory_seq_cp(self.mem, src, dst, -1, -1)

    def trim(self, seq_id: int, keep: int) -> None:
        if not llama().llama_memory_seq_rm(self.mem, seq_id, keep, -1):
            # the policy never asks a recurrent cache to step back further than it can
            # (max_rollback); should it, the sequence is cleared rather than left out of step, and
            # its next decode fails with a message instead of continuing from a wrong state
            llama().llama_memory_seq_rm(self.mem, seq_id, 0, -1)
            log.error("could not drop the cache of sequence %d from position %d on; cleared it", seq_id, keep)
        if self.mtp is not None:
            self.mtp.trim(seq_id, keep)

    @property
    def vision(self):
        """The weights' projector (llama/vision.py), or None: images need one."""
        return self.weights.projector

    def decode(self, step: DecodeStep) -> None:
        L = llama()
        texts = [e for e in step.entries if e.unit is None]
        for e in step.entries:
            if e.unit is not None:   # an image: its embeddings, by libmtmd's helper (M-RoPE, causality)
                rc = self.vision.decode(e.unit, self.ctx, e.position, e.job.slot.seq_id, max(self.spec.n_batch, 1))
                if rc != 0 and self.abort is not None and self.abort.is_set:
                    raise self._aborted(step)
                if rc != 0:
                    raise DecodeFailed(f"llama.cpp could not read an image into the context (code {rc})",
                                       fatal=rc < -1)
        if not texts:
            return
        # logits for an entry's last token and for each token drafted after it (speculative decoding)
        fill_batch(self.batch, ((t, e.position + k, e.job.slot.seq_id, e.output is not None and k >= e.count - 1)
                                for e in texts for k, t in enumerate(e.tokens())))
        tokens = sum(e.count + len(e.draft) for e in texts)
        # drafted tokens are no prompt chunk: verified beside a request's token, their thread count
        # is the tuner's (on 2 shared cores an extra drafted token cost 2 single-token steps on the
        # prompt threads, 0.5-0.7 on the decode ones)
        chunk = any(e.count > 1 for e in texts)
        want = self.tuner.choose(tokens, chunk)
        # llama.cpp runs a single token on its decode threads, more on its batch threads
        single, batch = (want, self._batch_threads) if tokens == 1 else (self._single_threads, want)
        if (single, batch) != (self._single_threads, self._batch_threads):
            L.llama_set_n_threads(self.ctx, single, batch)
            if self.pools is not None:
                self.pools.use(batch, single)
            self._single_threads, self._batch_threads = single, batch
        t0 = time.perf_counter()
        before = self.passes.count if self.passes is not None else 0
        rc = L.llama_decode(self.ctx, self.batch)
        self.tuner.observe(tokens, chunk, want, time.perf_counter() - t0)
        if self.passes is not None:
            self.passes.record(tokens, len(texts), self.passes.count - before)
        if rc == 2:
            raise self._aborted(step)
        if rc != 0:
            # 1 = no KV slot (should not happen: each sequence owns n_ctx cells), 2 = aborted,
            # -1 = invalid batch, below: a backend error (a device out of memory, say), after which
            # the context is not to be trusted
            raise DecodeFailed(f"llama_decode failed with code {rc}", fatal=rc < -1)
        if self.mtp is not None:   # the MTP cache reads what the target read (mtp.py)
            self.mtp.catch_up((None if e.job.units else e.job.slot.seq_id, e.position, e.tokens()) for e in texts)

    def synchronize(self) -> None:
        llama().llama_synchronize(self.ctx)

    def compile_grammar(self, json_schema: Any, gbnf: str | None, abandoned=None) -> Any:
        """The request's grammar matcher (grammar.py), compiled on the compile threads within the
        bounds of runtime/grammars.py; InvalidRequest naming what is wrong or which bound was met."""
        check_size(json_schema, gbnf)
        return compile_bounded(lambda: compile_matcher(self.weights, json_schema, gbnf), abandoned,
                               "json_schema" if json_schema is not None else "grammar")

    def _chain(self, sp, seed: int, taps: tuple | None = None):
        return chains.build(sp, seed, self.weights.n_vocab, self.weights.vocab_ptr,
                           self.weights.eog_tokens() if sp.ignore_eos else [], taps)

    def new_sampler(self, sp, seed: int, grammar: Any = None, seq_id: int | None = None,
                    entropy: bool = False) -> Sampler:
        """The request's chain; with `seq_id` (sampler_choice.choose said backend), attached to that
        sequence so the decode draws its tokens (and, with `entropy`, measures each row's entropy in
        the graph), else (or where llama.cpp refuses it) a CPU chain."""
        greedy = chain_greedy(sp)
        ban = self.weights.eog_tokens() if sp.ignore_eos else []
        if seq_id is not None and self.backend_sampling and grammar is None and sp.repeat_penalty == 1.0:
            key = (sp, seed, bool(entropy and self.backend_entropy))
            parked = self.chains.take(seq_id, key)   # the last request's chain there (attached.py)
            if parked is not None:
                return parked
            taps = graph_entropy.taps(llama()) if key[2] else None
            chain = self._chain(sp, seed, taps)
            sampler = Sampler(chain, greedy=greedy, ban=ban, entropy=taps is not None, key=key)
            if self.chains.attach(sampler, seq_id):
                return sampler
            # a chain that went through llama.cpp's backend set-up skips its backend part on the
            # CPU: a fresh one for the CPU
            llama().llama_sampler_free(chain)
        chain = self._chain(sp, seed)
        g = Grammar(grammar, self.weights.n_vocab, self.weights.eos) if grammar is not None else None
        # a grammar row goes through its matcher over the whole row (grammar.py), never candidates
        return Sampler(chain, greedy=greedy, grammar=g, ban=ban, candidates=chains.candidates(sp) if g is None else 0)

    def prepare(self, sampler: Sampler, seq_id: int, backend: bool) -> None:
        """Before a decode with an output row of `seq_id` for `sampler`'s request: a backend chain
        moved with its request to another sequence (a preempted request placed again), or displaced
        by another request's chain, is attached again. llama.cpp sets a chain up for the backend
        once in its life, so a copy with the same state (its random stream included) is attached."""
        if not backend:   # a CPU row: a parked chain there (or a displaced one) comes off
            self.chains.clear_for(seq_id, sampler)
            return
        if self.chains.holds(sampler, seq_id):
            return
        L = llama()
        self.chains.detach(sampler)
        copy = L.llama_sampler_clone(sampler.chain)
        L.llama_sampler_free(sampler.chain)
        sampler.chain = copy
        if not self.chains.attach(sampler, seq_id):
            raise DecodeFailed("llama.cpp refused to attach a sampler chain it took before")

    def free_sampler(self, sampler: Sampler) -> None:
        if not sampler or self.chains.park(sampler):   # parked: stays for the next request like it
            return
        self.chains.detach(sampler)
        if sampler.grammar is not None:
            sampler.grammar.free()
            sampler.grammar = None
        if sampler.chain:
            llama().llama_sampler_free(sampler.chain)
            sampler.chain = None

    def _sample_one(self, item) -> tuple[int, float | None]:
        sampler, row, want_entropy, ptr = item
        L = llama()
        if sampler.backend:
            # drawn in the decode; accepting it commits the chain's random draw (one per token taken)
            tok = L.llama_get_sampled_token_ith(self.ctx, row)
            if tok < 0:
                raise DecodeFailed(f"llama.cpp drew no token for output row {row} of sequence {sampler.seq_id}")
            L.llama_sampler_accept(sampler.chain, tok)
            ent = graph_entropy.read(L, self.ctx, row) if want_entropy and sampler.entropy else None
            if want_entropy and ent is None:   # sampler_choice gives such a request a chain with the taps
                raise DecodeFailed(f"llama.cpp measured no entropy for output row {row} of sequence {sampler.seq_id}")
            return tok, ent
        logits = np.ctypeslib.as_array(ptr, shape=(self.weights.n_vocab,))
        ent = entropy(logits) if want_entropy else None
        if sampler.grammar is not None:
            return sampler.grammar.pick(sampler.chain, logits, sampler.greedy), ent
        if sampler.greedy:
            # the chain's answer without its candidate array: llama_sampler_sample first copies the
            # whole row into n_vocab (id, logit, p) records (0.16 ms for a 152k vocabulary), ten
            # times an argmax over the row, per token and per sequence. Both take the first maximum.
            if sampler.ban:   # ignore_eos: the chain's -inf bias, on the row itself (read after the entropy)
                logits[sampler.ban] = -np.inf
            return int(logits.argmax()), ent
        # the chain over the few tokens that hold the row's top k (chain.candidates, rows.py); the
        # banned tokens among them get the chain's -inf bias, so the set holds the top k + len(ban)
        ids = top_candidates(logits, sampler.candidates + len(sampler.ban)) if sampler.candidates else None
        if ids is not None:
            return draw(L, sampler.chain, logits, ids), ent
        return L.llama_sampler_sample(sampler.chain, self.ctx, row), ent

    def logprobs(self, row: int, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
        logits = np.ctypeslib.as_array(llama().llama_get_logits_ith(self.ctx, row), shape=(self.weights.n_vocab,))
        z = logits - logits.max()
        lse = float(np.log(np.exp(z).sum()))
        top: list[tuple[int, float]] = []
        if n > 0:
            idx = np.argpartition(-z, min(n, len(z) - 1))[:n]
            idx = idx[np.argsort(-z[idx])]
            top = [(int(i), float(z[i]) - lse) for i in idx]
        return float(z[token]) - lse, top

    def sample_rows(self, rows):
        """Sample every row; the rows with work (a sampler chain over the whole row, an entropy) in
        parallel threads when there are several (rows.py).

        A backend row is one integer to read (the draw happened in the decode), a greedy row an
        argmax: handing those to threads costs more than it saves (measured at 16 greedy rows on an
        H200: 1471 tokens/s in threads, 1835 one after another). llama.cpp's output bookkeeping is
        updated by the first read of a step, so every row's logits are looked up here, on the worker
        thread, before any other thread reads one."""
        L = llama()
        items = [(s, row, want, None if s.backend else L.llama_get_logits_ith(self.ctx, row))
                 for s, row, want in rows]
        work = [heavy(want, s.greedy, s.backend, s.candidates) for s, _, want, _ in items]
        if self._pool is None or sum(work) < THREADS_FROM:
            return [self._sample_one(it) for it in items]
        out: list = [None] * len(items)
        futures = {i: self._pool.submit(self._sample_one, it) for i, it in enumerate(items) if work[i]}
        for i, it in enumerate(items):   # light rows here meanwhile (backend rows stay on this thread)
            if not work[i]:
                out[i] = self._sample_one(it)
        for i, f in futures.items():
            out[i] = f.result()
        return out

    # -- embeddings ---------------------------------------------------------------------------
    def embed(self, token_lists: list[list[int]], pooling: str) -> np.ndarray:
        return self.embed_contexts.embed(token_lists, pooling)

    # -- teardown -----------------------------------------------------------------------------
    def idle(self) -> None:
        if self.pools is not None:
            self.pools.idle()

    def close(self) -> None:
        L = llama()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.batch is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        self.embed_contexts.close()
        if self.mtp is not None:   # before the target context it reads from
            self.mtp.close()
            self.mtp = None
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        self.chains.close()
        if self.pools is not None:   # after the context (threadpool.Pools.free)
            self.pools.free()
            self.pools = None
