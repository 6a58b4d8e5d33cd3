"""Structured output: JSON schemas and GBNF grammars compiled by llguidance and matched per token.

Why llguidance (a dependency, not a converter of our own): it implements the JSON-schema semantics
llama.cpp documents (strings with escapes only where JSON has them, integer and number bounds,
string and array length bounds, `pattern` through a real regex engine that refuses a pattern that
does not parse, allOf/anyOf/oneOf/$ref, the common formats) and says which keywords it does not
implement; it reads GBNF through its converter to Lark; and its matcher computes a whole-vocabulary
mask in well under a millisecond for ordinary grammars, with explicit fuel limits on every step
(`LIMITS`), so no grammar can make one token cost more than a bounded amount of work. llama.cpp's
own grammar sampler has neither bound: it matches every candidate's text against every stack of
the grammar, and a grammar of a few thousand alternatives held every other request for seconds per
token. (llama-cpp-python's json_schema_to_gbnf, used before, let raw control characters into
strings and dropped minimum/maximum.)

Compilation (grammar text, the vocabulary as llguidance's tokenizer, the request's matcher) runs on
runtime/grammars.py's compile threads, bounded in size and time; the worker only asks the matcher
for a mask or a check per token. A token is drawn the way llama.cpp's common sampler draws one: the
request's chain picks from the raw row, the matcher checks that one token, and only when it refuses
is the row masked and the chain run again. When the matcher errs (a step over its fuel, say), the
request ends with that error and the others go on.
"""
from __future__ import annotations

import ctypes
import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from ..errors import InvalidRequest
from .binding import llama

#: llama_token_data as numpy sees it: (id int32, logit float, p float), 12 bytes like the C struct
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])

#: JSON output as llama.cpp's converter writes it: whitespace between tokens at most a space, or a
#: newline and an indent (a sampled answer cannot drift into endless blank space); oneOf read as
#: anyOf, as llama.cpp reads it (llguidance refuses oneOf otherwise; docs/structured-output.md says
#: what that means for overlapping branches). These override whatever a schema's "x-guidance" asks.
JSON_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": r"[ ]?|\n[ \t]{0,20}", "lenient": False,
                "coerce_one_of": True}


def _limits():
    import llguidance

    # per token: lexer fuel ~14k/ms and Earley items ~20k/ms (llguidance's own figures), so a step
    # stays within a few milliseconds whatever the grammar; compile: its defaults
    return llguidance.LLParserLimits(step_lexer_fuel=50_000, step_max_items=20_000, verbose_errors=False)


_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_templates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()
#: compiled matchers kept per vocabulary (a request copies one instead of compiling again)
CACHE = 16


def tokenizer(weights) -> Any:
    """llguidance's view of the model's vocabulary (every token's bytes, control tokens marked as
    llguidance's llama.cpp binding marks them; the end-of-generation tokens as its EOS), made once per
    loaded model (about a second for 50k tokens)."""
    with _lock:
        tok = _tokenizers.get(weights)
    if tok is not None:
        return tok
    import llguidance

    L = llama()
    n = 16 * 1024
    buf = ctypes.create_string_buffer(n + 1)
    pieces: list[bytes] = []
    with weights.use():
        v = weights.vocab_ptr
        for t in range(weights.n_vocab):
            k = L.llama_token_to_piece(v, t, buf, n, 0, True)
            piece = bytes(buf[:max(0, min(k, n))])
            attr = L.llama_vocab_get_attr(v, t)
            if attr & L.LLAMA_TOKEN_ATTR_CONTROL or (attr & L.LLAMA_TOKEN_ATTR_USER_DEFINED
                                                     and piece.startswith(b"<") and piece.endswith(b">")):
                piece = b"\xff" + piece   # llguidance's mark of a special token
            pieces.append(piece)
        eos = weights.eog_tokens() or [weights.eos]
        fptr = ctypes.cast(L.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
        tok = llguidance.LLTokenizer.from_llamacpp(tokens=pieces, vocab_ptr=v, tokenize_fptr=fptr, eos_token=eos,
                                                   slices=None)
    with _lock:
        return _tokenizers.setdefault(weights, tok)


def grammar_text(json_schema: Any, gbnf: str | None) -> str:
    """llguidance's grammar for a JSON schema (a dict) or GBNF text; InvalidRequest naming what is wrong."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    from ..grammars import check_schema, closed_objects

    if json_schema is not None:
        check_schema(json_schema)
        try:
            text = json.dumps(closed_objects(json_schema), allow_nan=False)
            return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"The json_schema does not compile: {one_line(e)}") from None
    try:
        lark = any_to_lark(gbnf)
    except RecursionError:
        raise InvalidRequest("The grammar does not parse: it nests too deeply.") from None
    except Exception as e:   # noqa: BLE001 - the converter raises what it meets (ValueError, KeyError, ...)
        raise InvalidRequest(f"The grammar does not parse: {one_line(e)}. It needs a 'root' rule (GBNF, as llama.cpp's "
                             "grammars/ folder shows).") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def one_line(text: str) -> str:
    """A compiler's message on one line (a regex error draws a caret under the pattern)."""
    return " | ".join(ln.strip() for ln in str(text).splitlines() if ln.strip())


#: words of llguidance's messages when one of its limits (LIMITS), not the text, is the problem
LIMIT_WORDS = ("max is", "too big", "too complex", "limit", "fuel")


def refuse(what: str, message: str) -> InvalidRequest:
    msg = one_line(message)
    if any(w in msg.lower() for w in LIMIT_WORDS):
        return InvalidRequest(f"The {what} is over the compiler's bounds on work per token and size: {msg}. "
                              "Simplify it (fewer alternatives in one rule, smaller enums).")
    if what == "grammar":
        return InvalidRequest(f"The grammar does not parse: {msg}")
    return InvalidRequest(f"The json_schema does not compile: {msg}")


def check_text(what: str, text: str) -> str:
    """`text` (grammar_text's) when it compiles without a vocabulary, else InvalidRequest: the checks
    an engine without llama.cpp's vocabulary can make."""
    import llguidance

    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, None, limits=_limits())
    if failed:
        raise refuse(what, messages[0] if messages else "no detail")
    return text


def compile_matcher(weights, json_schema: Any, gbnf: str | None) -> Any:
    """A fresh llguidance matcher for one request, or InvalidRequest with the compiler's message.
    Runs on a compile thread (runtime/grammars.py), never the worker's."""
    import llguidance

    what = "json_schema" if json_schema is not None else "grammar"
    text = grammar_text(json_schema, gbnf)
    tok = tokenizer(weights)
    with _lock:
        cache = _templates.setdefault(weights, OrderedDict())
        template = cache.get(text)
        if template is not None:
            cache.move_to_end(text)
    if template is None:
        template = llguidance.LLMatcher(tok, text, log_level=0, limits=_limits())
        if template.is_error():
            raise refuse(what, template.get_error())
        with _lock:
            cache[text] = template
            while len(cache) > CACHE:
                cache.popitem(last=False)
    return template.deep_copy()


class Grammar:
    """One request's matcher over the model's rows. `error` is set (and the end-of-generation
    token returned) when the matcher fails; the worker ends the request with it."""

    def __init__(self, matcher, n_vocab: int, eos: int):
        self.m = matcher
        self.n_vocab = n_vocab
        self.eos = eos
        self.error: str | None = None
        self._cands: np.ndarray | None = None
        self.checks = 0
        self.filtered = 0

    def _fail(self, what: str) -> int:
        reason = one_line(self.m.get_error())[:500] or self.m.stop_reason()
        self.error = (f"The grammar could not go on ({what}): {reason}. A grammar must let each token be "
                      "checked within a bounded amount of work; simplify it.")
        return self.eos

    def pick(self, chain, logits: np.ndarray, greedy: bool) -> int:
        """The token for one row: the chain's choice if the grammar allows it, else the chain's
        choice among what the grammar allows. Accepted into the chain and the matcher."""
        m = self.m
        if m.is_error():
            return self._fail("earlier")
        if m.is_stopped():   # complete: only the end may follow
            return self.eos
        self.checks += 1
        tok = self._choose(chain, logits, greedy)
        if tok is None or m.validate_tokens([tok]) != 1:
            self.filtered += 1
            mask = m.compute_bitmask()
            if m.is_error():
                return self._fail("a token mask")
            allowed = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:self.n_vocab]
            if not allowed.any():
                return self.eos
            masked = np.where(allowed.astype(bool), logits, np.float32(-np.inf)).astype(np.float32, copy=False)
            tok = self._choose(chain, masked, greedy)
            if tok is None or not allowed[tok]:
                return self.eos
        if not m.consume_token(tok):
            return self._fail("a token")
        if not greedy:
            llama().llama_sampler_accept(chain, tok)
        return tok

    def _choose(self, chain, logits: np.ndarray, greedy: bool) -> int | None:
        if greedy:
            i = int(logits.argmax())
            return i if np.isfinite(logits[i]) else None
        if self._cands is None:
            self._cands = np.zeros(self.n_vocab, dtype=TOKEN_DATA)
        c = self._cands
        c["id"] = np.arange(self.n_vocab, dtype=np.int32)   # the chain's samplers reorder the buffer
        c["logit"] = logits
        c["p"] = 0.0
        L = llama()
        arr = L.llama_token_data_array(data=c.ctypes.data_as(L.llama_token_data_p), size=len(c),
                                       selected=-1, sorted=False)
        L.llama_sampler_apply(chain, ctypes.byref(arr))
        i = arr.selected
        if not 0 <= i < arr.size or not np.isfinite(c["logit"][i]):
            return None
        return int(c["id"][i])

    def free(self) -> None:
        self.m = None


__all__ = ["Grammar", "check_text", "compile_matcher", "grammar_text", "tokenizer"]
