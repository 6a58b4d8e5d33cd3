"""Structured output with llama.cpp's grammar sampler: a JSON schema becomes a GBNF grammar
(llama-cpp-python's converter, the same as llama.cpp's json-schema-to-grammar), checked against the
vocabulary, and applied per request while the answer is sampled.

llama.cpp's grammar sampler is slow over a large vocabulary (every candidate's text is matched
against the grammar's stacks), so it is used the way llama.cpp's own common sampler does: the
request's chain picks a token from the raw candidates, the grammar checks that one token, and only
when the grammar rejects it are all candidates filtered by the grammar and the chain run again. Most
tokens of a JSON answer are what the model would write anyway, so most steps cost one check.

A token the grammar rejects is never accepted into it (llama.cpp throws inside its accept, which
through the C API would end the process): when no candidate is left, the end-of-generation token
is returned and the grammar is left as it is.
"""
from __future__ import annotations

import ctypes
import json
from typing import Any

import numpy as np

from ..errors import InvalidRequest
from .binding import llama, log_mark, log_since

#: llama_token_data as numpy sees it: (id int32, logit float, p float), 12 bytes like the C struct
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
ROOT = b"root"


def schema_to_gbnf(schema: Any) -> str:
    """The GBNF grammar of a JSON schema (a dict), or InvalidRequest saying why it does not convert."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        text = json.dumps(schema, allow_nan=False)
        return json_schema_to_gbnf(text)
    except RecursionError:
        raise InvalidRequest("The JSON schema does not compile to a grammar: it nests too deeply.") from None
    except Exception as e:   # noqa: BLE001 - the converter raises what it meets (KeyError, ValueError, ...)
        raise InvalidRequest(f"The JSON schema does not compile to a grammar ({type(e).__name__}: {e}). "
                             "Check it with a JSON-schema validator; $ref to other files is not followed.") from None


def check_gbnf(vocab_ptr, gbnf: str) -> None:
    """InvalidRequest when llama.cpp's grammar parser refuses `gbnf` (with its own message)."""
    L = llama()
    mark = log_mark()
    ptr = L.llama_sampler_init_grammar(vocab_ptr, gbnf.encode("utf-8"), ROOT)
    if not ptr:
        detail = " | ".join(ln.strip() for ln in log_since(mark).splitlines() if ln.strip())[-300:]
        raise InvalidRequest(f"The grammar does not parse: {detail or 'llama.cpp gave no detail'}. It needs a "
                             "'root' rule (GBNF, as llama.cpp's grammars/ folder shows).")
    L.llama_sampler_free(ptr)


class Grammar:
    """One request's grammar sampler and its candidate buffer (made on first use)."""

    def __init__(self, vocab_ptr, gbnf: str, n_vocab: int, eos: int):
        self.ptr = llama().llama_sampler_init_grammar(vocab_ptr, gbnf.encode("utf-8"), ROOT)
        if not self.ptr:
            raise InvalidRequest("The grammar does not parse (it did at submit: the model changed?).")
        self.n_vocab = n_vocab
        self.eos = eos
        self._cands: np.ndarray | None = None
        self._one = np.zeros(1, dtype=TOKEN_DATA)
        self.checks = 0
        self.filtered = 0

    def _array(self, cands: np.ndarray):
        L = llama()
        return L.llama_token_data_array(data=cands.ctypes.data_as(L.llama_token_data_p), size=len(cands),
                                        selected=-1, sorted=False)

    def allows(self, token: int) -> bool:
        self.checks += 1
        one = self._one
        one[0] = (token, 0.0, 0.0)
        arr = self._array(one)
        llama().llama_sampler_apply(self.ptr, ctypes.byref(arr))
        return bool(np.isfinite(one[0]["logit"]))

    def pick(self, chain, logits: np.ndarray, greedy: bool) -> int:
        """The token for one row: the chain's choice if the grammar allows it, else the chain's
        choice among what the grammar allows. Accepted into the chain and the grammar."""
        L = llama()
        tok = self._choose(chain, logits, greedy, filtered=False)
        if tok is None or not self.allows(tok):
            self.filtered += 1
            tok = self._choose(chain, logits, greedy, filtered=True)
            if tok is None:
                return self.eos
        if not greedy:
            L.llama_sampler_accept(chain, tok)
        L.llama_sampler_accept(self.ptr, tok)
        return tok

    def _choose(self, chain, logits: np.ndarray, greedy: bool, filtered: bool) -> int | None:
        if greedy and not filtered:
            return int(logits.argmax())
        if self._cands is None:
            self._cands = np.zeros(self.n_vocab, dtype=TOKEN_DATA)
            self._cands["id"] = np.arange(self.n_vocab, dtype=np.int32)
        c = self._cands
        c["id"] = np.arange(self.n_vocab, dtype=np.int32)   # the chain's samplers reorder the buffer
        c["logit"] = logits
        c["p"] = 0.0
        arr = self._array(c)
        L = llama()
        if filtered:
            L.llama_sampler_apply(self.ptr, ctypes.byref(arr))
            if greedy:
                allowed = c["logit"][:arr.size]
                i = int(allowed.argmax())
                return int(c["id"][i]) if np.isfinite(allowed[i]) else None
        L.llama_sampler_apply(chain, ctypes.byref(arr))
        i = arr.selected
        if not 0 <= i < arr.size or not np.isfinite(c["logit"][i]):
            return None
        return int(c["id"][i])

    def free(self) -> None:
        if self.ptr:
            llama().llama_sampler_free(self.ptr)
            self.ptr = None


__all__ = ["Grammar", "check_gbnf", "schema_to_gbnf"]
