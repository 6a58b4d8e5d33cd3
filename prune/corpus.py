"""Calibration and held-out text that every Python installation has, with no download.

Code is the standard library's own source, prose is the language reference in
`pydoc_data/topics.py`. The calibration and held-out parts are fixed, disjoint lists (below); the
texts differ a little between Python versions, so every output records the lists actually found and
a SHA-256 digest of the exact calibration text.
"""
from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

# Standard-library modules, by import name (stable across versions, unlike file paths).
CALIBRATION_MODULES = (
    "argparse", "ast", "bisect", "calendar", "collections", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "difflib", "enum", "fractions", "functools", "gettext", "glob", "heapq",
    "inspect", "ipaddress", "json.decoder", "json.encoder", "logging", "operator", "pathlib", "pprint",
    "queue", "random", "shlex", "shutil", "statistics", "string", "tempfile", "textwrap", "threading",
    "tokenize", "typing", "uuid", "zipfile",
)
HELDOUT_MODULES = (
    "abc", "base64", "codecs", "dis", "fnmatch", "hashlib", "hmac", "html.parser", "numbers", "optparse",
    "pickle", "sched", "selectors", "smtplib", "timeit", "traceback", "urllib.parse", "warnings", "weakref",
)
# Topics of pydoc_data.topics held out for evaluation; every other topic is calibration text.
HELDOUT_TOPICS = (
    "assignment", "calls", "comparisons", "exceptions", "execmodel", "formatstrings", "import",
    "numeric-types", "typesmapping", "with",
)


@dataclass
class Corpus:
    kind: str                      # "code" or "prose"
    split: str                     # "calibration" or "heldout"
    items: list[tuple[str, str]] = field(default_factory=list)  # (name, text)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.items]

    @property
    def n_chars(self) -> int:
        return sum(len(t) for _, t in self.items)

    def digest(self) -> str:
        h = hashlib.sha256()
        for name, text in self.items:
            h.update(name.encode() + b"\0" + text.encode("utf-8") + b"\0")
        return h.hexdigest()


def _module_source(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        return Path(spec.origin).read_text(encoding="utf-8")
    except OSError:
        return None


def code_corpus(split: str) -> Corpus:
    mods = CALIBRATION_MODULES if split == "calibration" else HELDOUT_MODULES
    c = Corpus("code", split)
    for m in mods:
        src = _module_source(m)
        if src:
            c.items.append((m, src))
    return c


def prose_corpus(split: str) -> Corpus:
    from pydoc_data.topics import topics

    held = set(HELDOUT_TOPICS)
    keys = sorted(k for k in topics if (k in held) == (split == "heldout"))
    return Corpus("prose", split, [(k, topics[k]) for k in keys])


def corpora(split: str) -> dict[str, Corpus]:
    return {"code": code_corpus(split), "prose": prose_corpus(split)}


def calibration_digest() -> str:
    h = hashlib.sha256()
    for c in corpora("calibration").values():
        h.update(c.digest().encode())
    return h.hexdigest()


def windows(tokenize: Callable[[str], list[int]], corpus: Corpus, seq_len: int, max_windows: int,
            bos: int | None = None) -> list[list[int]]:
    """Non-overlapping token windows, taken round-robin over the corpus items so every item counts.

    `bos` (when the model adds one) starts every window, as llama.cpp would see it. Only as much of
    each text is tokenized as its windows need (see `_Tokens`).
    """
    body = seq_len - (1 if bos is not None else 0)
    whole = max_windows >= 1 << 20
    items = [_Tokens(tokenize, text, body, whole) for _, text in corpus.items]
    out: list[list[int]] = []
    depth = 0
    while len(out) < max_windows:
        found = False
        for it in items:
            if len(out) >= max_windows:
                break
            w = it.window(depth)
            if w is not None:
                out.append(([bos] if bos is not None else []) + w)
                found = True
        if not found:
            break
        depth += 1
    return out


class _Tokens:
    """The tokens of one text, tokenized lazily by prefix.

    Tokenizing a whole corpus for a few windows per item took most of a pruning run's start on large
    vocabularies (20 s for 64 windows). A prefix of the text is tokenized instead, growing by doubling;
    the last `MARGIN` tokens of a prefix are not used, since a word cut at the prefix's end tokenizes
    differently, so the windows are those of the whole text's tokens.
    """

    MARGIN = 32

    def __init__(self, tokenize: Callable[[str], list[int]], text: str, body: int, whole: bool = False):
        self.tokenize, self.text, self.body = tokenize, text, body
        self.chars = len(text) if whole else 0
        self.toks: list[int] = tokenize(text) if whole else []
        self.complete = whole

    def window(self, d: int) -> list[int] | None:
        need = (d + 1) * self.body
        while not self.complete and len(self.toks) < need:
            self.chars = max(2 * self.chars, need * 6 + 1024)
            if self.chars >= len(self.text):
                self.toks, self.complete = self.tokenize(self.text), True
            else:
                self.toks = self.tokenize(self.text[:self.chars])[:-self.MARGIN]
        return self.toks[need - self.body:need] if len(self.toks) >= need else None


def interleave(*lists: Iterable[list[int]]) -> list[list[int]]:
    its = [list(x) for x in lists]
    out: list[list[int]] = []
    for i in range(max((len(x) for x in its), default=0)):
        for x in its:
            if i < len(x):
                out.append(x[i])
    return out
