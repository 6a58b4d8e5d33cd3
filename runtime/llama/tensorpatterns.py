"""Tensor placement patterns (`override_tensor`) matched in linear time, handed to llama.cpp as names.

llama.cpp matches each override pattern against every tensor name with `std::regex`, a backtracking
engine: a pattern such as `(.*)*x` or `^([\\w.]+)+!` takes time exponential in the name's length, and
the load hangs. So the user's patterns never reach it. They are compiled with RE2 (google-re2), a
linear-time engine, and matched here against the tensor names of the file's index; llama.cpp gets
the exact names each pattern matched, escaped and anchored (`^(?:blk\\.0\\.ffn_up_exps\\.weight|...)$`),
patterns that cannot backtrack. The placement is the one the user's patterns give, with llama.cpp's
rule kept: the first pattern that matches a tensor decides.

What RE2 cannot express (lookaround, back-references, a repetition count above 1000) is refused
with RE2's words and the pattern. Anchors: `^` and `$` mean the start and end of the name in both
engines; `\\A` and `\\Z` (Perl's and Python's start and end of text, which ECMAScript reads as the
letters A and Z) mean the start and end of the name here too: `\\Z` is RE2's `\\z`.
"""
from __future__ import annotations

import re
import sys
from functools import lru_cache

from ..errors import InvalidRequest

#: names per pattern handed to llama.cpp: std::regex follows an alternation recursively, one level
#: per alternative, so a pattern stays short (and the stack shallow) however many tensors match
NAMES_PER_PATTERN = 32


def _translated(pattern: str) -> str:
    """`pattern` with `\\Z` (end of text, as in Python) spelt as RE2 spells it (`\\z`)."""
    out, i = [], 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            out.append("\\z" if nxt == "Z" else ch + nxt)
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


#: patterns this package writes (the planner's layer patterns): no user text, nothing that
#: backtracks, so Python's re matches them and a placement needs no RE2
_OURS: set[str] = set()


def ours(pattern: str) -> str:
    """`pattern`, marked as written here (matched with Python's re)."""
    _OURS.add(pattern)
    return pattern


@lru_cache(maxsize=256)
def compiled(pattern: str):
    """The RE2 object for a user pattern; InvalidRequest (one line) for what RE2 cannot express.

    RE2's extension loads the system's C++ runtime. Beside a llama.cpp build that carries its own
    copy (docs/gpu.md), importing it crashed the process (a CUDA build, llama.cpp loaded first), so
    there a user pattern is refused with what to do instead."""
    if pattern in _OURS:
        return re.compile(pattern)
    if "re2" not in sys.modules:
        from . import cxxruntime

        carriers = cxxruntime.carriers()
        if carriers:
            raise InvalidRequest(f"override_tensor patterns need RE2, which cannot load beside this llama.cpp build: "
                                 f"{', '.join(carriers)} carries its own copy of the C++ runtime. Rebuild "
                                 "llama-cpp-python as the README's GPU section shows, or leave override_tensor out "
                                 "(cpu_moe, n_cpu_moe and the automatic placement need no patterns of yours).")
    import re2

    options = re2.Options()
    options.log_errors = False
    try:
        return re2.compile(_translated(pattern), options)
    except re2.error as e:
        why = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise InvalidRequest(f"override_tensor pattern {pattern!r} is not a valid regular expression for a "
                             f"linear-time match ({why}); lookahead, lookbehind, back-references and repetition "
                             "counts above 1000 are not supported.") from None


def matches(pattern: str, name: str) -> bool:
    """Whether `pattern` matches anywhere in `name` (llama.cpp's regex_search), in linear time."""
    return compiled(pattern).search(name) is not None


def escaped(name: str) -> str:
    """`name` as an ECMAScript pattern matching exactly that text: every ASCII character that is not
    a letter, a digit or _ escaped (an identity escape in ECMAScript)."""
    return "".join("\\" + c if c.isascii() and not (c.isalnum() or c == "_") else c for c in name)


def exact(names: list[str]) -> str:
    """One anchored pattern matching exactly `names`."""
    return "^(?:" + "|".join(escaped(n) for n in names) + ")$"


def for_llama(entries: list[tuple[str, str]], names: list[str], limit: int) -> list[tuple[str, str]]:
    """The (pattern, device) entries to hand llama.cpp for the user's `entries` over a file whose tensors
    are `names`: each user pattern becomes the exact names it matches that no earlier pattern took
    (llama.cpp's first match decides), in patterns of NAMES_PER_PATTERN names; a pattern matching
    nothing gives nothing. `limit`: the most entries llama.cpp takes."""
    out: list[tuple[str, str]] = []
    taken: set[str] = set()
    for pattern, device in entries:
        hit = [n for n in names if n not in taken and matches(pattern, n)]
        taken.update(hit)
        for i in range(0, len(hit), NAMES_PER_PATTERN):
            out.append((exact(hit[i:i + NAMES_PER_PATTERN]), device))
    if len(out) > limit:
        raise InvalidRequest(f"override_tensor places {len(taken)} tensors, which takes {len(out)} of llama.cpp's "
                             f"at most {limit} overrides; place fewer tensors by hand (join patterns with |, "
                             "or use cpu_moe / n_cpu_moe for the experts).")
    return out
