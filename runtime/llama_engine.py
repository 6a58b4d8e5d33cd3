"""The in-process llama.cpp engine: one loaded llama_model, contexts over it, and the scheduler.

Built on llama-cpp-python's public ctypes API (`llama_model_load_from_file`, `llama_init_from_model`,
`llama_decode`, the sampler chain). We do not construct `llama_cpp.Llama`: it owns its model, so a
second object for embeddings would load the file a second time.

Threading model: llama.cpp contexts are not thread-safe. Each `LoadedModel` has one worker thread
that is the only caller of `llama_decode` on its contexts. Callers on any thread submit work and get
a `GenerationStream` back. The worker runs continuous batching: every step puts one token of each
running sequence (or a chunk of a prompt) into one `llama_batch`, so concurrent requests share a
decode. Only the highest priority class present runs in a step, so an editor request is never
slowed by a long workflow generation running beside it, and a waiting interactive request may
preempt (pause) a batch request when all sequence slots are taken; the paused request resumes later
from its own KV cache when its slot is still intact.
"""
from __future__ import annotations

import collections
import ctypes
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .errors import (Cancelled, EmbeddingsUnsupported, InvalidRequest, LlamaCppUnavailable, ModelLoadFailed,
                     ModelUnloaded, PromptTooLong, TruncatedGGUF, UnsupportedArchitecture)
from .gguf_info import FILE_TYPES
from .options import POOLINGS
from .generation import (GenerationRequest, GenerationResult, GenerationStream, TextAssembler,
                         TokenEvent)

log = logging.getLogger("a3b.llama")

_lib = None
_lib_lock = threading.Lock()
_recent_log: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=400)  # (seq, level, text)
_log_seq = 0
_log_cb = None  # keep a reference: llama.cpp holds the pointer

GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


def llama():
    """Import llama_cpp once, initialise the backend and route llama.cpp's log into `logging`."""
    global _lib, _log_cb
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        try:
            import llama_cpp
        except Exception as e:  # ImportError, or OSError from a broken shared library
            raise LlamaCppUnavailable(
                f"llama-cpp-python is not usable ({type(e).__name__}: {e}). Install it with "
                "'pip install llama-cpp-python' (CPU) or see the README for a CUDA/Metal build."
            ) from e

        @llama_cpp.llama_log_callback
        def _cb(level: int, text: bytes, user_data):  # called from C, with the GIL
            global _log_seq
            s = text.decode("utf-8", "replace")
            _log_seq += 1
            _recent_log.append((_log_seq, level, s))
            log.debug("llama.cpp: %s", s.rstrip())

        _log_cb = _cb
        llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _lib = llama_cpp
        return _lib


def llama_cpp_version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("llama-cpp-python")
    except Exception:
        return "unknown"


def system_info() -> dict[str, Any]:
    L = llama()
    return {
        "llama_cpp_python": llama_cpp_version(),
        "system_info": L.llama_print_system_info().decode("utf-8", "replace").strip(),
        "gpu_offload": bool(L.llama_supports_gpu_offload()),
        "mmap": bool(L.llama_supports_mmap()),
        "mlock": bool(L.llama_supports_mlock()),
    }


def _log_mark() -> int:
    return _log_seq


def _log_since(mark: int) -> str:
    """llama.cpp's log lines since `mark`: its load errors arrive there, not as return values."""
    return "".join(s for seq, _, s in list(_recent_log) if seq > mark)


def _unknown_arch_from_log(text: str) -> str | None:
    import re

    m = re.search(r"unknown model architecture: '([^']+)'", text)
    return m.group(1) if m else None


def probe_architecture(path: str | os.PathLike) -> tuple[bool, str]:
    """Ask the installed llama.cpp whether it knows a file's architecture, without loading weights.

    A vocab-only load reads the metadata and builds the tokenizer; an unknown architecture fails
    there, before any tensor is touched.
    """
    L = llama()
    params = L.llama_model_default_params()
    params.vocab_only = True
    mark = _log_mark()
    with _lib_lock:
        ptr = L.llama_model_load_from_file(str(path).encode("utf-8"), params)
    if ptr:
        L.llama_model_free(ptr)
        return True, "supported"
    text = _log_since(mark)
    unknown = _unknown_arch_from_log(text)
    if unknown:
        return False, f"unknown architecture {unknown!r}"
    return False, (text.strip().splitlines() or ["load failed"])[-1]


def _load_error(path: Path, log_text: str) -> Exception:
    """Turn llama.cpp's load failure (a NULL and some log lines) into a typed error."""
    unknown = _unknown_arch_from_log(log_text)
    if unknown:
        return unsupported_error(unknown)
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "fail" in ln.lower()]
    detail = " | ".join((errors or lines)[-2:]) or "no detail"
    if ("not within the file bounds" in log_text or "failed to read" in log_text
            or "corrupted or incomplete" in log_text):
        return TruncatedGGUF(f"{path} is truncated or damaged ({detail}). Copy or download the file again.")
    return ModelLoadFailed(f"llama.cpp could not load {path}: {detail}")


def unsupported_error(arch: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(
        f"The installed llama.cpp (llama-cpp-python {llama_cpp_version()}) does not know the "
        f"architecture {arch!r}. Upgrade llama-cpp-python (pip install -U llama-cpp-python), "
        "or pick a model of a supported architecture.")


class Weights:
    """One loaded llama_model (the weights), shared by every context and spec that uses the file."""

    def __init__(self, path: Path, n_gpu_layers: int = 0, use_mmap: bool = True):
        L = llama()
        self.path = path
        params = L.llama_model_default_params()
        params.n_gpu_layers = int(n_gpu_layers)
        params.load_mode = L.LLAMA_LOAD_MODE_MMAP if use_mmap else L.LLAMA_LOAD_MODE_NONE
        mark = _log_mark()
        t0 = time.perf_counter()
        ptr = L.llama_model_load_from_file(str(path).encode("utf-8"), params)
        self.load_seconds = time.perf_counter() - t0
        if not ptr:
            raise _load_error(path, _log_since(mark))
        self.ptr = ptr
        self.vocab = L.llama_model_get_vocab(ptr)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = L.llama_model_n_ctx_train(ptr)
        self.n_embd = L.llama_model_n_embd(ptr)
        self.n_layer = L.llama_model_n_layer(ptr)
        self.n_head = L.llama_model_n_head(ptr)
        self.n_head_kv = L.llama_model_n_head_kv(ptr)
        self.architecture = self.meta("general.architecture") or "unknown"
        ftype = self.meta("general.file_type")
        self.file_type = FILE_TYPES.get(int(ftype), ftype) if ftype and ftype.isdigit() else ftype
        self.size_bytes = int(L.llama_model_size(ptr))
        self.has_encoder = bool(L.llama_model_has_encoder(ptr))
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.bos = L.llama_vocab_bos(self.vocab)
        self.eos = L.llama_vocab_eos(self.vocab)
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._buf = ctypes.create_string_buffer(256)
        self._piece_lock = threading.Lock()
        self.refs = 0
        self._adapters: dict[str, Any] = {}

    # -- vocabulary (read-only, safe from any thread) ---------------------------------------------
    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        L = llama()
        data = text.encode("utf-8")
        n = len(data) + 8
        buf = (L.llama_token * n)()
        got = L.llama_tokenize(self.vocab, data, len(data), buf, n, add_bos, special)
        if got < 0:
            n = -got
            buf = (L.llama_token * n)()
            got = L.llama_tokenize(self.vocab, data, len(data), buf, n, add_bos, special)
        return list(buf[:got])

    def piece(self, token: int) -> bytes:
        p = self._pieces.get(token)
        if p is None:
            L = llama()
            with self._piece_lock:
                n = L.llama_token_to_piece(self.vocab, token, self._buf, len(self._buf), 0, False)
                if n < 0:
                    self._buf = ctypes.create_string_buffer(-n + 1)
                    n = L.llama_token_to_piece(self.vocab, token, self._buf, len(self._buf), 0, False)
                p = self._buf.raw[:n]
            self._pieces[token] = p
        return p

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        v = self._eog.get(token)
        if v is None:
            v = self._eog[token] = bool(llama().llama_vocab_is_eog(self.vocab, token))
        return v

    def token_text(self, token: int) -> str:
        return llama().llama_vocab_get_text(self.vocab, token).decode("utf-8", "replace")

    def special_tokens(self) -> dict[str, int]:
        """FIM and other special token ids (-1 when the model has none)."""
        L = llama()
        v = self.vocab
        return {"bos": self.bos, "eos": self.eos, "eot": L.llama_vocab_eot(v),
                "fim_pre": L.llama_vocab_fim_pre(v), "fim_suf": L.llama_vocab_fim_suf(v),
                "fim_mid": L.llama_vocab_fim_mid(v), "fim_pad": L.llama_vocab_fim_pad(v),
                "fim_rep": L.llama_vocab_fim_rep(v), "fim_sep": L.llama_vocab_fim_sep(v)}

    def meta(self, key: str) -> str | None:
        L = llama()
        buf = ctypes.create_string_buffer(1 << 16)
        n = L.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            L.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def adapter(self, path: str):
        """A LoRA adapter loaded over these weights (once per path)."""
        a = self._adapters.get(path)
        if a is None:
            a = llama().llama_adapter_lora_init(self.ptr, path.encode("utf-8"))
            if not a:
                raise ModelLoadFailed(f"Could not load LoRA adapter {path}: is it a GGUF LoRA made for "
                                      f"this base model ({self.path.name})?")
            self._adapters[path] = a
        return a

    def free(self) -> None:
        if self.ptr:
            L = llama()
            for a in self._adapters.values():
                L.llama_adapter_lora_free(a)
            self._adapters.clear()
            L.llama_model_free(self.ptr)
            self.ptr = None


@dataclass
class ContextOptions:
    n_ctx: int = 2048          # per sequence (per concurrent request)
    n_parallel: int = 2        # sequence slots for concurrent requests
    n_batch: int = 256         # tokens per decode step; prompts are fed in chunks of this size
    n_threads: int = 0         # 0 = automatic (see thread_counts)
    flash_attn: str = "auto"   # auto | on | off
    kv_cache_type: str = "f16"
    lora_path: str | None = None
    lora_scale: float = 1.0
    embed_n_ctx: int = 256     # tokens per embedded text at most (longer texts are refused)
    # Texts are packed into one decode up to this many tokens. llama.cpp computes a logits row for
    # every token of a pooled batch (n_vocab floats each: 192 KB for the default model), so the
    # pack size, not the context, decides the memory an embedding batch touches.
    embed_pack: int = 32
    embed_n_seq: int = 8


def thread_counts(n_threads: int = 0) -> tuple[int, int]:
    """(decode threads, prompt threads). 0 = automatic: half the cores for decoding, all for prompts.

    Decoding one token is memory-bound and its threads meet at a barrier after every operation: on
    a busy machine a descheduled thread stalls the others (measured here on 2 shared cores: 2 decode
    threads gave 11-60 tokens/s, 1 thread 78-81). Prompt processing is compute-bound and uses all cores.
    This matches llama-cpp-python's own defaults.
    """
    if n_threads > 0:
        return n_threads, n_threads
    cores = os.cpu_count() or 1
    return max(1, cores // 2), cores


def _ctx_params(opts: ContextOptions, *, embeddings: bool, pooling: str = "mean"):
    L = llama()
    p = L.llama_context_default_params()
    p.n_threads, p.n_threads_batch = thread_counts(opts.n_threads)
    if embeddings:
        # Pooling happens inside llama.cpp (pooling != NONE), so only one vector per text leaves the
        # graph. A text must fit one micro-batch for pooling, so ubatch = context. Kept small by
        # default (LoadSpec.embed_n_ctx): llama.cpp clears the whole KV buffer at creation, so
        # every cell costs memory at once (256 tokens: 6 MB for the default model).
        p.n_ctx = p.n_batch = p.n_ubatch = opts.embed_n_ctx
        p.n_seq_max = opts.embed_n_seq
        p.embeddings = True
        p.pooling_type = {"mean": L.LLAMA_POOLING_TYPE_MEAN, "cls": L.LLAMA_POOLING_TYPE_CLS,
                          "last": L.LLAMA_POOLING_TYPE_LAST}[pooling]
        p.kv_unified = True
    else:
        p.n_ctx = opts.n_ctx * opts.n_parallel
        p.n_batch = max(opts.n_batch, opts.n_parallel)
        p.n_ubatch = p.n_batch
        p.n_seq_max = opts.n_parallel
        # unified=False gives every sequence exactly n_ctx cells of its own
        p.kv_unified = opts.n_parallel == 1
    p.flash_attn_type = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                         "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}[opts.flash_attn]
    kt = GGML_TYPES[opts.kv_cache_type]
    p.type_k = p.type_v = kt
    p.no_perf = True
    return p


def _entropy(logits: np.ndarray) -> float:
    """Shannon entropy (nats) of softmax(logits)."""
    m = logits.max()
    z = logits - m
    e = np.exp(z)
    s = e.sum()
    return float(np.log(s) - (e @ z) / s)


class _Slot:
    def __init__(self, seq_id: int):
        self.seq_id = seq_id
        self.tokens: list[int] = []   # tokens whose KV is in this sequence, in order
        self.job: _Job | None = None
        self.last_used = 0.0


class _Job:
    def __init__(self, stream: GenerationStream, prompt_tokens: list[int], seed: int, sampler):
        self.stream = stream
        self.req: GenerationRequest = stream.request
        self.prompt_tokens = prompt_tokens
        self.seq = list(prompt_tokens)   # prompt + generated tokens
        self.n_gen = 0
        self.fed = 0                     # tokens of seq whose KV is in the slot
        self.took = 0                    # tokens of seq put into the current decode step
        self.slot: _Slot | None = None
        self.seed = seed
        self.sampler = sampler
        self.asm = TextAssembler(stream.request.stop, stream.request.confidence)
        self.n_cached: int | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.started = time.perf_counter()


@dataclass
class _EmbedJob:
    token_lists: list[list[int]]
    pooling: str
    normalize: bool
    priority: int
    done: threading.Event = field(default_factory=threading.Event)
    result: np.ndarray | None = None
    error: BaseException | None = None


class LoadedModel:
    """Weights + a generation context (n_parallel slots) + a lazy embedding context + the worker."""

    def __init__(self, weights: Weights, opts: ContextOptions, name: str = ""):
        self.weights = weights
        self.opts = opts
        self.name = name or weights.path.name
        L = llama()
        if opts.kv_cache_type not in GGML_TYPES:
            raise InvalidRequest(f"Unknown KV cache type {opts.kv_cache_type!r}; choose one of {', '.join(GGML_TYPES)}")
        mark = _log_mark()
        self.ctx = L.llama_init_from_model(weights.ptr, _ctx_params(opts, embeddings=False))
        if not self.ctx:
            detail = [ln.strip() for ln in _log_since(mark).splitlines() if "error" in ln.lower() or "fail" in ln.lower()]
            raise ModelLoadFailed(f"llama.cpp could not create a context (n_ctx={opts.n_ctx} x "
                                  f"{opts.n_parallel}, kv={opts.kv_cache_type}, flash_attn={opts.flash_attn}): "
                                  f"{' | '.join(detail[-2:]) or 'no detail'}. Try a smaller n_ctx, or kv_cache_type f16.")
        self.mem = L.llama_get_memory(self.ctx)
        if opts.lora_path:
            adapters = (L.llama_adapter_lora_p_ctypes * 1)(weights.adapter(opts.lora_path))
            scales = (ctypes.c_float * 1)(opts.lora_scale)
            L.llama_set_adapters_lora(self.ctx, adapters, 1, scales)
        self.n_ctx_seq = opts.n_ctx
        self.batch = L.llama_batch_init(max(opts.n_batch, opts.n_parallel), 0, 1)
        self.slots = [_Slot(i) for i in range(opts.n_parallel)]
        self.ectxs: dict[str, Any] = {}   # pooling -> embedding context, made on first use
        self.ebatch = None
        self._lock = threading.Condition()
        self._pending: list[_Job] = []
        self._live: set[_Job] = set()  # every submitted, unfinished job: none is ever left hanging
        self._embed_jobs: collections.deque[_EmbedJob] = collections.deque()
        self._closing: str | None = None
        self.closed = threading.Event()
        self.stats = collections.Counter()
        self.created = time.time()
        self.last_used = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"a3b-sched-{self.name}", daemon=True)
        self._thread.start()

    # -- public, any thread ------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        return self.weights.tokenize(text, add_bos=add_bos, special=special)

    def submit(self, request: GenerationRequest, on_token: Callable[[TokenEvent], None] | None = None) -> GenerationStream:
        request.validate()
        if request.prompt_tokens is not None:
            tokens = list(request.prompt_tokens)
        else:
            tokens = self.weights.tokenize(request.prompt, add_bos=request.add_bos and self.weights.add_bos,
                                           special=request.parse_special)
        if not tokens:
            raise InvalidRequest("The prompt tokenizes to nothing; give some text to continue.")
        if len(tokens) >= self.n_ctx_seq:
            raise PromptTooLong(f"The prompt has {len(tokens)} tokens but the context holds {self.n_ctx_seq} "
                                "(including the answer). Shorten the prompt or load the model with a larger n_ctx.")
        bad = [t for t in tokens if not 0 <= t < self.weights.n_vocab]
        if bad:
            raise InvalidRequest(f"Token ids outside the vocabulary (0..{self.weights.n_vocab - 1}): {bad[:5]}")
        stream = GenerationStream(request, on_token)
        sp = request.sampling
        seed = sp.seed if sp.seed is not None else random.randrange(2**32)
        job = _Job(stream, tokens, seed, self._make_sampler(request, seed))
        with self._lock:
            if self._closing:
                self._free_sampler(job)
                raise ModelUnloaded(f"{self.name} is being unloaded ({self._closing}); load it again.")
            self._pending.append(job)
            self._live.add(job)
            self.stats["submitted"] += 1
            self._lock.notify()
        return stream

    def embed_tokens(self, token_lists: list[list[int]], pooling: str = "mean", normalize: bool = True,
                     priority: int = 0, timeout: float | None = None) -> np.ndarray:
        if pooling not in POOLINGS:
            raise InvalidRequest(f"Unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
        for i, toks in enumerate(token_lists):
            if not toks:
                raise InvalidRequest(f"Text #{i} is empty; embeddings need at least one token.")
            if len(toks) > self.opts.embed_n_ctx:
                raise PromptTooLong(f"Text #{i} has {len(toks)} tokens; embeddings take at most "
                                    f"{self.opts.embed_n_ctx} per text. Split it into chunks, or load "
                                    "the model with a larger embed_n_ctx.")
        job = _EmbedJob(token_lists, pooling, normalize, priority)
        with self._lock:
            if self._closing:
                raise ModelUnloaded(f"{self.name} is being unloaded ({self._closing}); load it again.")
            self._embed_jobs.append(job)
            self._lock.notify()
        if not job.done.wait(timeout):
            raise TimeoutError("embedding still running")
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def busy(self) -> bool:
        with self._lock:
            return bool(self._pending or self._embed_jobs or any(s.job for s in self.slots))

    def close(self, reason: str = "unloaded", wait: bool = True) -> None:
        """Stop: running and queued requests fail with ModelUnloaded, then contexts are freed."""
        with self._lock:
            if not self._closing:
                self._closing = reason
            self._lock.notify()
        if wait and threading.current_thread() is not self._thread:
            self.closed.wait()

    # -- worker ----------------------------------------------------------------------------------
    def _make_sampler(self, req: GenerationRequest, seed: int):
        L = llama()
        sp = req.sampling
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        add = lambda s: L.llama_sampler_chain_add(chain, s)  # noqa: E731
        # top-k first when it is on: the penalty sampler is slow over the whole vocabulary
        if sp.temperature > 0 and sp.top_k > 0:
            add(L.llama_sampler_init_top_k(sp.top_k))
        if sp.repeat_penalty != 1.0:
            add(L.llama_sampler_init_penalties(self.weights.n_vocab, sp.repeat_last_n, sp.repeat_penalty, 0.0, 0.0))
        if sp.temperature <= 0:
            add(L.llama_sampler_init_greedy())
        else:
            if sp.top_p < 1.0:
                add(L.llama_sampler_init_top_p(sp.top_p, 1))
            if sp.min_p > 0:
                add(L.llama_sampler_init_min_p(sp.min_p, 1))
            add(L.llama_sampler_init_temp(sp.temperature))
            add(L.llama_sampler_init_dist(seed))
        return chain

    def _free_sampler(self, job: _Job) -> None:
        if job.sampler:
            llama().llama_sampler_free(job.sampler)
            job.sampler = None

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while (not self._closing and not self._pending and not self._embed_jobs
                           and not any(s.job for s in self.slots)):
                        self._lock.wait()
                    if self._closing:
                        break
                    self._admit()
                    ejob = self._next_embed_job()
                if ejob is not None:
                    self._run_embed(ejob)
                    continue
                self._step()
        except BaseException as e:  # never leave callers hanging
            log.exception("scheduler of %s crashed", self.name)
            self._closing = self._closing or f"scheduler error: {e}"
        finally:
            self._shutdown()

    def _top_priority(self) -> int | None:
        prios = [s.job.req.priority for s in self.slots if s.job]
        return max(prios) if prios else None

    def _next_embed_job(self) -> _EmbedJob | None:
        if not self._embed_jobs:
            return None
        top = self._top_priority()
        if top is None or self._embed_jobs[0].priority >= top:
            return self._embed_jobs.popleft()
        return None

    def _admit(self) -> None:
        """Move pending jobs into free slots (called with the lock held)."""
        # cancelled while waiting: finish without touching a slot
        for job in [j for j in self._pending if j.stream.cancelled]:
            self._pending.remove(job)
            self._finish(job, "cancelled")
        self._pending.sort(key=lambda j: (-j.req.priority, j.stream.id))
        while self._pending:
            job = self._pending[0]
            free = [s for s in self.slots if s.job is None]
            if not free:
                victims = [s for s in self.slots if s.job and s.job.req.priority < job.req.priority]
                if not victims:
                    return
                victim = min(victims, key=lambda s: (s.job.req.priority, -s.job.stream.id))
                self._preempt(victim)
                free = [victim]
            self._pending.pop(0)
            self._place(job, free)

    def _preempt(self, slot: _Slot) -> None:
        job = slot.job
        job.slot = None
        slot.job = None
        slot.last_used = time.monotonic()
        self._pending.append(job)
        self.stats["preempted"] += 1

    def _place(self, job: _Job, free: list[_Slot]) -> None:
        L = llama()

        def lcp(a: list[int], b: list[int]) -> int:
            n = min(len(a), len(b))
            i = 0
            while i < n and a[i] == b[i]:
                i += 1
            return i

        best = max(free, key=lambda s: (lcp(s.tokens, job.seq), -s.last_used))
        common = min(lcp(best.tokens, job.seq), len(job.seq) - 1)
        if common < len(best.tokens):
            L.llama_memory_seq_rm(self.mem, best.seq_id, common, -1)
            del best.tokens[common:]
        job.fed = common
        if job.n_cached is None:
            job.n_cached = min(common, len(job.prompt_tokens))
            self.stats["prompt_tokens"] += len(job.prompt_tokens)
            self.stats["cached_prompt_tokens"] += job.n_cached
        job.slot = best
        best.job = job

    def _step(self) -> None:
        L = llama()
        top = self._top_priority()
        if top is None:
            return
        jobs = [s.job for s in self.slots if s.job and s.job.req.priority == top]
        # cancellation is checked between tokens, before spending a decode on the job
        for job in list(jobs):
            if job.stream.cancelled:
                jobs.remove(job)
                with self._lock:
                    self._release_slot(job)
                self._finish(job, "cancelled")
        if not jobs:
            return
        b = self.batch
        budget = b_cap = max(self.opts.n_batch, self.opts.n_parallel)
        n = 0
        outputs: list[tuple[_Job, int]] = []
        # running sequences first (1 token each), then prompt chunks share what is left
        for job in sorted(jobs, key=lambda j: len(j.seq) - j.fed):
            todo = len(job.seq) - job.fed
            take = min(todo, budget)
            if take <= 0:
                continue
            for k in range(take):
                pos = job.fed + k
                b.token[n] = job.seq[pos]
                b.pos[n] = pos
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = job.slot.seq_id
                last = k == take - 1 and take == todo
                b.logits[n] = last
                if last:
                    outputs.append((job, n))
                n += 1
            job.took = take
            budget -= take
            if budget <= 0:
                break
        assert n <= b_cap
        b.n_tokens = n
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            # 1 = no KV slot: should not happen since each sequence owns n_ctx cells
            err = ModelLoadFailed(f"llama_decode failed with code {rc}")
            for job in jobs:
                with self._lock:
                    self._release_slot(job, keep_cache=False)
                self._finish(job, "error", err)
            return
        self.stats["decode_calls"] += 1
        self.stats["decoded_tokens"] += n
        for job in jobs:
            if job.took:
                job.slot.tokens.extend(job.seq[job.fed:job.fed + job.took])
                job.fed += job.took
                job.took = 0
        now = time.perf_counter()
        for job, idx in outputs:
            self._sample(job, idx, now)

    def _sample(self, job: _Job, idx: int, now: float) -> None:
        L = llama()
        w = self.weights
        ent = None
        if job.req.confidence.enabled:
            ptr = L.llama_get_logits_ith(self.ctx, idx)
            ent = _entropy(np.ctypeslib.as_array(ptr, shape=(w.n_vocab,)))
        tok = L.llama_sampler_sample(job.sampler, self.ctx, idx)
        if job.t_first is None:
            job.t_first = now
        job.t_last = now
        job.n_gen += 1
        self.stats["generated_tokens"] += 1
        if w.is_eog(tok):
            if ent is not None:
                job.asm.entropies.append(ent)
            return self._finish_slot(job, "stop")
        job.seq.append(tok)
        text = job.asm.add(w.piece(tok), ent)
        job.stream._emit(TokenEvent(text, tok, ent))
        if job.asm.stopped:
            return self._finish_slot(job, "stop")
        if job.n_gen >= job.req.max_tokens:
            return self._finish_slot(job, "length")
        if len(job.seq) >= self.n_ctx_seq:
            return self._finish_slot(job, "length")

    def _finish_slot(self, job: _Job, reason: str) -> None:
        with self._lock:
            self._release_slot(job)
        self._finish(job, reason)

    def _release_slot(self, job: _Job, keep_cache: bool = True) -> None:
        slot = job.slot
        if slot is None:
            return
        if not keep_cache:
            llama().llama_memory_seq_rm(self.mem, slot.seq_id, 0, -1)
            slot.tokens.clear()
        slot.job = None
        slot.last_used = time.monotonic()
        job.slot = None

    def _finish(self, job: _Job, reason: str, error: BaseException | None = None) -> None:
        with self._lock:
            self._live.discard(job)
        tail = job.asm.flush()
        if tail:
            job.stream._emit(TokenEvent(tail, -1, None))
        text, spans = job.asm.final_text()
        end = time.perf_counter()
        gen = job.seq[len(job.prompt_tokens):]
        result = GenerationResult(
            text=text, tokens=gen, finish_reason=reason, n_prompt_tokens=len(job.prompt_tokens),
            n_cached_prompt_tokens=job.n_cached or 0, seed=job.seed, spans=spans,
            entropies=list(job.asm.entropies),
            time_to_first_token=(job.t_first - job.stream.submitted_at) if job.t_first else 0.0,
            total_time=end - job.stream.submitted_at,
            decode_time=(job.t_last - job.t_first) if job.t_first and job.t_last else 0.0)
        self._free_sampler(job)
        self.last_used = time.monotonic()
        self.stats[f"finished_{reason}"] += 1
        if reason == "cancelled" and error is None:
            if job.stream.cancel_reason.startswith("unloaded"):
                error = ModelUnloaded(f"{self.name} was unloaded while this request ran; "
                                      f"{len(gen)} tokens were generated before it stopped.")
            else:
                error = Cancelled(f"Generation cancelled after {len(gen)} tokens.")
            error.partial = result  # nothing is lost: the text so far travels with the error
        job.stream._finish(result if error is None else None, error)

    # -- embeddings --------------------------------------------------------------------------
    def _embed_ctx(self, pooling: str):
        ctx = self.ectxs.get(pooling)
        if ctx:
            return ctx
        L = llama()
        mark = _log_mark()
        ctx = L.llama_init_from_model(self.weights.ptr, _ctx_params(self.opts, embeddings=True, pooling=pooling))
        if not ctx:
            detail = " | ".join(ln.strip() for ln in _log_since(mark).splitlines() if "error" in ln.lower())
            raise EmbeddingsUnsupported(f"llama.cpp could not create a {pooling}-pooling embedding context for "
                                        f"{self.name}: {detail or 'no detail'}")
        self.ectxs[pooling] = ctx
        if self.ebatch is None:
            self.ebatch = L.llama_batch_init(self.opts.embed_n_ctx, 0, 1)
        return ctx

    def _run_embed(self, job: _EmbedJob) -> None:
        try:
            L = llama()
            ctx = self._embed_ctx(job.pooling)
            mem = L.llama_get_memory(ctx)
            out = np.zeros((len(job.token_lists), self.weights.n_embd), dtype=np.float32)
            i = 0
            while i < len(job.token_lists):
                if self._closing:
                    raise ModelUnloaded(f"{self.name} was unloaded during embedding.")
                # pack texts into one decode: at most embed_n_seq texts and embed_pack tokens
                group, total = [], 0
                while (i + len(group) < len(job.token_lists) and len(group) < self.opts.embed_n_seq
                       and (not group or total + len(job.token_lists[i + len(group)]) <= self.opts.embed_pack)):
                    total += len(job.token_lists[i + len(group)])
                    group.append(job.token_lists[i + len(group)])
                b = self.ebatch
                n = 0
                for s, toks in enumerate(group):
                    for p, t in enumerate(toks):
                        b.token[n], b.pos[n], b.n_seq_id[n] = t, p, 1
                        b.seq_id[n][0] = s
                        # one output row per text: llama.cpp pools over the whole sequence anyway,
                        # and every flagged row would also reserve a logits row of n_vocab floats
                        b.logits[n] = p == len(toks) - 1
                        n += 1
                b.n_tokens = n
                if mem:
                    L.llama_memory_clear(mem, False)  # metadata only: zeroing would touch every page
                rc = (L.llama_encode if self.weights.has_encoder else L.llama_decode)(ctx, b)
                if rc != 0:
                    raise EmbeddingsUnsupported(f"llama.cpp failed to compute embeddings (code {rc}).")
                for s in range(len(group)):
                    ptr = L.llama_get_embeddings_seq(ctx, s)
                    if not ptr:
                        raise EmbeddingsUnsupported(f"{self.name} returned no pooled embedding.")
                    out[i + s] = np.ctypeslib.as_array(ptr, shape=(self.weights.n_embd,))
                i += len(group)
                self.stats["embedded_texts"] += len(group)
                self.stats["embedded_tokens"] += n
            if job.normalize:
                norms = np.linalg.norm(out, axis=1, keepdims=True)
                out = out / np.maximum(norms, 1e-12)
            job.result = out
        except BaseException as e:
            job.error = e
        finally:
            job.done.set()

    # -- shutdown ----------------------------------------------------------------------------
    def _shutdown(self) -> None:
        L = llama()
        reason = self._closing or "unloaded"
        with self._lock:
            jobs = list(self._live)
            self._pending.clear()
            for s in self.slots:
                s.job = None
            ejobs = list(self._embed_jobs)
            self._embed_jobs.clear()
        for job in jobs:
            job.stream.cancel(f"unloaded: {reason}")
            try:
                self._finish(job, "cancelled")
            except Exception as e:  # the stream must end even if building its result fails
                job.stream._finish(None, ModelUnloaded(f"{self.name} stopped: {reason} ({e})"))
        for ej in ejobs:
            ej.error = ModelUnloaded(f"{self.name} was unloaded ({reason}) before the embedding ran.")
            ej.done.set()
        if self.batch is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if self.ebatch is not None:
            L.llama_batch_free(self.ebatch)
            self.ebatch = None
        for ctx in self.ectxs.values():
            L.llama_free(ctx)
        self.ectxs.clear()
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        self.closed.set()
