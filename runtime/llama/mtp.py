"""Drafting with a model's own multi-token-prediction ("nextn") layers, through llama.cpp's MTP context.

A Qwen3.5 GGUF may carry a nextn block after its trunk: a full-attention decoder block that reads
the embedding of token x_p together with the trunk's last hidden state at the previous position,
h_{p-1}, and predicts token x_{p+1} with the model's own output head. llama.cpp runs that block in
a second context over the same loaded model (`ctx_type = MTP`, `ctx_other` = the target context),
which keeps its own KV cache for the one block. The protocol, as llama.cpp's speculative driver
uses it:

* The target context outputs h for every token it decodes (`llama_set_embeddings_nextn`,
  unmasked: one row per batch token, not only the rows with logits).
* After every target decode, the MTP context reads the same tokens at the same positions, each
  paired with h of the position before it (`catch_up`): its KV then covers what the target's does.
  The first token of a sequence in a batch pairs with the last row kept from an earlier decode (or
  zeros where none is known: a draft gets worse there, nothing gets wrong).
* A draft for a sequence whose next token x_p (sampled, not decoded yet) sits at position p starts
  from (x_p, h_{p-1}); each MTP step yields logits for the next token (drafted greedily: an argmax)
  and the block's own h, which pairs with the drafted token at the next position (`draft`). The
  drafted positions then leave the MTP cache again: the target's verify step feeds them properly.
* Whatever the target trims, the MTP cache trims at the same position (`trim`).

llama.cpp exports the nextn switches only as C++ functions (its staging header), so they are bound
here by their mangled names. Greedy drafting is deterministic, which is what makes verification by
the request's own sampler exact (speculative.py).
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidRequest
from .binding import llama, log_mark, log_since

_F32P = ctypes.POINTER(ctypes.c_float)
#: llama-ext.h's staging API (C++ linkage): name -> (mangled symbol, argument types, result type)
_SYMBOLS = {
    "set_embeddings_nextn": ("_Z26llama_set_embeddings_nextnP13llama_contextbb",
                             [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None),
    "get_embeddings_nextn_ith": ("_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                                 [ctypes.c_void_p, ctypes.c_int32], _F32P),
}
_bound: dict[str, Any] = {}


def _fn(name: str):
    """A staging-API function, bound once; InvalidRequest when this llama.cpp build lacks it."""
    f = _bound.get(name)
    if f is None:
        symbol, args, res = _SYMBOLS[name]
        lib = getattr(getattr(llama(), "llama_cpp", None), "_lib", None)
        try:
            f = lib[symbol]
        except (AttributeError, KeyError, TypeError) as e:
            raise InvalidRequest("This llama.cpp build has no multi-token-prediction support (no "
                                 f"llama_{name}); use speculative=ngram or draft:MODEL.") from e
        f.argtypes, f.restype = args, res
        _bound[name] = f
    return f


def available() -> bool:
    """Whether the installed llama.cpp can run an MTP context."""
    L = llama()
    if not hasattr(L, "LLAMA_CONTEXT_TYPE_MTP") or not hasattr(L, "llama_process"):
        return False
    try:
        for name in _SYMBOLS:
            _fn(name)
    except InvalidRequest:
        return False
    return True


class _Rows:
    """One sequence's target hidden states by position: the rows of its latest decode, valid below
    `end` (a trim lowers it; rows above it belong to tokens no longer in the cache)."""

    __slots__ = ("first", "rows", "end")

    def __init__(self, first: int, rows: np.ndarray):
        self.first, self.rows, self.end = first, rows, first + len(rows)

    def at(self, pos: int) -> np.ndarray | None:
        return self.rows[pos - self.first] if self.first <= pos < self.end else None


class MtpContext:
    """The MTP context beside one target context, and the per-sequence state that keeps it in step."""

    def __init__(self, weights: Any, target_ctx: Any, params: Any):
        """`params`: the target's llama_context_params (sizes, threads, KV types), made MTP here."""
        L = llama()
        self.target = target_ctx
        self.n_embd = int(L.llama_model_n_embd(weights.ptr))
        self.n_vocab = int(weights.n_vocab)
        params.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        params.ctx_other = target_ctx
        params.n_rs_seq = 0
        mark = log_mark()
        with weights.use():
            self.ctx = L.llama_init_from_model(weights.ptr, params)
        if not self.ctx:
            detail = " | ".join(ln.strip() for ln in log_since(mark).splitlines() if "mtp" in ln.lower()
                                or "error" in ln.lower())
            raise InvalidRequest(f"llama.cpp could not create the multi-token-prediction context for "
                                 f"{weights.info.name}: {detail or 'no detail'}. Use speculative=ngram.")
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_ext_init(self.ctx)
        _fn("set_embeddings_nextn")(target_ctx, True, False)   # h for every target token
        _fn("set_embeddings_nextn")(self.ctx, True, True)      # h for the drafted rows only
        self._rows: dict[int, _Rows] = {}
        self._zero = np.zeros(self.n_embd, dtype=np.float32)
        self._want: dict[int, tuple[int, int, int]] = {}       # seq -> (token, position, k)
        self._done: dict[int, list[int]] = {}
        self.failures = 0

    # -- keeping in step ---------------------------------------------------------------------
    def _h_before(self, seq_id: int, pos: int) -> np.ndarray:
        r = self._rows.get(seq_id)
        h = r.at(pos - 1) if r is not None else None
        return self._zero if h is None else h

    def _add(self, seq_id: int, token: int, pos: int, h: np.ndarray, output: bool) -> int:
        L = llama()
        idx = L.llama_batch_ext_add_token(self.batch, seq_id, int(token))
        if idx < 0:
            raise RuntimeError(f"MTP batch full ({idx})")
        L.llama_batch_ext_set_pos(self.batch, idx, ctypes.byref(ctypes.c_int32(pos)))
        if not L.llama_batch_ext_set_embd_token(self.batch, idx, L.llama_embd(h.ctypes.data_as(_F32P), 1, self.n_embd)):
            raise RuntimeError("MTP batch refused a hidden state")
        if output:
            L.llama_batch_ext_set_output_logits(self.batch, idx, True)
        return idx

    def _process(self) -> None:
        L = llama()
        rc = L.llama_process(self.ctx, L.LLAMA_PROCESS_TYPE_DECODE, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_process on the MTP context returned {rc}")

    def catch_up(self, runs: Iterable[tuple[int, int, Sequence[int]]]) -> None:
        """The target just decoded `runs` ((seq_id, first position, tokens), in batch order, one
        batch row per token): read them into the MTP cache, and keep their hidden states. A run
        whose seq_id is None takes its rows and is not read (a prompt with images: never drafted)."""
        L = llama()
        get_h = _fn("get_embeddings_nextn_ith")
        L.llama_batch_ext_clear(self.batch)
        row, kept = 0, []
        fed = 0
        for seq_id, pos0, tokens in runs:
            n = len(tokens)
            if seq_id is None:
                row += n
                continue
            rows = np.empty((n, self.n_embd), dtype=np.float32)
            for i in range(n):
                ptr = get_h(self.target, row + i)
                if not ptr:
                    raise RuntimeError("the target context gave no hidden state")
                rows[i] = np.ctypeslib.as_array(ptr, shape=(self.n_embd,))
            for i, t in enumerate(tokens):
                self._add(seq_id, t, pos0 + i, self._h_before(seq_id, pos0) if i == 0 else rows[i - 1], False)
            kept.append((seq_id, _Rows(pos0, rows)))
            row += n
            fed += n
        for seq_id, r in kept:
            self._rows[seq_id] = r
        if fed:
            self._process()

    def trim(self, seq_id: int, keep: int) -> None:
        """The target keeps positions below `keep` of `seq_id`: so does the MTP cache."""
        llama().llama_memory_seq_rm(self.mem, seq_id, keep, -1)
        r = self._rows.get(seq_id)
        if r is not None:
            r.end = min(r.end, keep)

    # -- drafting ----------------------------------------------------------------------------
    def want(self, seq_id: int, token: int, pos: int, k: int) -> None:
        """Ask for up to `k` drafted tokens after `token` (the sequence's next token, at `pos`)."""
        self._want[seq_id] = (int(token), int(pos), int(k))
        self._done.pop(seq_id, None)

    def take(self, seq_id: int) -> list[int]:
        """The drafts asked for `seq_id`; the first call of a step drafts for every sequence at once."""
        if self._want:
            self._draft_all()
        return self._done.pop(seq_id, [])

    def _draft_all(self) -> None:
        want, self._want = self._want, {}
        L = llama()
        get_h = _fn("get_embeddings_nextn_ith")
        live = {s: (tok, pos, self._h_before(s, pos)) for s, (tok, pos, k) in want.items() if k > 0}
        out: dict[int, list[int]] = {s: [] for s in want}
        step = 0
        try:
            while live:
                L.llama_batch_ext_clear(self.batch)
                rows = {s: self._add(s, tok, pos + step, h, True) for s, (tok, pos, h) in live.items()}
                self._process()
                nxt = {}
                for s, idx in rows.items():
                    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))
                    tok = int(logits.argmax())
                    out[s].append(tok)
                    ptr = get_h(self.ctx, idx)
                    if ptr and len(out[s]) < want[s][2]:
                        nxt[s] = (tok, live[s][1], np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy())
                live, step = nxt, step + 1
        except RuntimeError:
            self.failures += 1
            raise
        finally:   # the drafted positions leave the MTP cache: the target's verify step feeds them
            for s, (_, pos, _) in want.items():
                L.llama_memory_seq_rm(self.mem, s, pos, -1)
            self._done.update(out)

    def close(self) -> None:
        L = llama()
        if self.batch is not None:
            L.llama_batch_ext_free(self.batch)
            self.batch = None
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
