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

    `bos` (when the model adds one) starts every window, as llama.cpp would see it.
    """
    body = seq_len - (1 if bos is not None else 0)
    per_item: list[list[list[int]]] = []
    for _, text in corpus.items:
        toks = tokenize(text)
        per_item.append([toks[i:i + body] for i in range(0, len(toks) - body + 1, body)])
    out: list[list[int]] = []
    depth = 0
    while len(out) < max_windows and any(depth < len(w) for w in per_item):
        for ws in per_item:
            if depth < len(ws) and len(out) < max_windows:
                out.append(([bos] if bos is not None else []) + ws[depth])
        depth += 1
    return out


def interleave(*lists: Iterable[list[int]]) -> list[list[int]]:
    its = [list(x) for x in lists]
    out: list[list[int]] = []
    for i in range(max((len(x) for x in its), default=0)):
        for x in its:
            if i < len(x):
                out.append(x[i])
    return out
