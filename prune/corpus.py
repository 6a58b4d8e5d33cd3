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


# -- the wide corpus: what a machine has without a download -------------------------------------------
#
# Recovery learns from the teacher's distribution on text, so more and more varied text helps it more
# than more passes over the same text (measured: 40x the tokens on the calibration corpus stalled,
# adding other code moved held-out code). Sources, each read only as training signal or measure:
#
# - stdlib:   the standard library's modules beyond the calibration and held-out lists (code);
# - packages: the sources of every installed distribution (code) and their documentation files (prose),
#             one unit per top-level package; a fixed tenth of the packages (by a hash of the name) is
#             held out whole;
# - pydoc:    the language reference topics (prose; the held-out topics stay held out);
# - debian:   /usr/share/doc (READMEs, guides; not copyright files or changelogs) (prose);
# - man:      English manual pages (prose), held out whole: it is prose from another source than any
#             text calibration or recovery reads.
# Texts are deduplicated by content (vendored copies); held-out units never enter the recovery split.

WIDE_MAX_FILE = 400_000          # characters; larger files are generated data more often than not
HELDOUT_PACKAGE_MOD = 10         # packages with sha256(name) % 10 == 0 are held out


def _read(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:4096]:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if 64 <= len(text) <= WIDE_MAX_FILE else None


def _stdlib_dir() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"])


def _site_dirs() -> list[Path]:
    import site

    dirs = [Path(p) for p in site.getsitepackages()]
    return [d for d in dirs if d.is_dir()]


def held_out_package(name: str) -> bool:
    return int(hashlib.sha256(name.lower().encode()).hexdigest(), 16) % HELDOUT_PACKAGE_MOD == 0


def _stdlib_units() -> list[tuple[str, str]]:
    """Standard-library sources outside the calibration and held-out modules, as (module, text)."""
    root = _stdlib_dir()
    fixed = {m.split(".")[0] for m in CALIBRATION_MODULES + HELDOUT_MODULES}
    fixed_files = set()
    for m in CALIBRATION_MODULES + HELDOUT_MODULES:
        try:
            spec = importlib.util.find_spec(m)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin:
            fixed_files.add(Path(spec.origin).resolve())
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        top = rel.parts[0]
        # pydoc_data holds the language reference topics, the prose corpus (held-out topics included)
        skip = ("site-packages", "dist-packages", "test", "idlelib", "lib2to3", "turtledemo", "pydoc_data")
        if top in skip or "tests" in rel.parts:
            continue
        if p.resolve() in fixed_files or (len(rel.parts) == 1 and p.stem in fixed):
            continue
        text = _read(p)
        if text:
            out.append((".".join(rel.with_suffix("").parts), text))
    return out


def _package_units() -> dict[str, list[tuple[str, str, str]]]:
    """Per top-level package in site-packages: (kind, relative name, text) for .py and doc files."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    own = Path(__file__).resolve().parents[1]
    for site_dir in _site_dirs():
        for top in sorted(site_dir.iterdir()):
            if top.name.endswith((".dist-info", ".egg-info")) or top.name.startswith(("_", ".")):
                continue
            if top.resolve() == own or not top.is_dir():
                continue
            items = out.setdefault(top.name, [])
            for p in sorted(top.rglob("*")):
                if not p.is_file() or "tests" in p.parts or "test" in p.parts:
                    continue
                kind = "code" if p.suffix == ".py" else "prose" if p.suffix in (".md", ".rst", ".txt") else None
                if kind is None:
                    continue
                text = _read(p)
                if text:
                    items.append((kind, str(p.relative_to(site_dir)), text))
    return out


_TROFF_ESC = __import__("re").compile(r"\\f[BIRP]|\\f\(..|\\\(..|\\[&|^~]|\\s[+-]?\d")


def man_to_text(src: str) -> str:
    """Plain text of a troff manual page (headings and paragraphs; macros and font escapes dropped)."""
    import re

    lines = []
    for ln in src.splitlines():
        if ln.startswith(('.\\"', "'\\\"")):
            continue
        if ln.startswith("."):
            m = re.match(r"\.(SH|SS|B|I|BI|BR|IR|RB|RI|IB|TP|IP|PP|LP|P|TH|Nm|Nd|Sh|Fl|Ar)\b\s*(.*)", ln)
            if not m:
                continue
            ln = m.group(2).replace('"', "")
            if not ln:
                continue
        ln = _TROFF_ESC.sub("", ln).replace("\\-", "-").replace("\\e", "\\").replace("\\ ", " ")
        lines.append(ln)
    return "\n".join(lines)


def _man_units(limit_chars: int) -> list[tuple[str, str]]:
    import gzip

    root = Path("/usr/share/man")
    out, total = [], 0
    for sec in sorted(root.glob("man[1-8]")):
        for p in sorted(sec.iterdir()):
            try:
                raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
                text = man_to_text(raw.decode("utf-8"))
            except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
                continue
            if len(text) >= 400:
                out.append((p.name, text))
                total += len(text)
                if total >= limit_chars:
                    return out
    return out


def _debian_units(limit_chars: int) -> list[tuple[str, str]]:
    import gzip

    root = Path("/usr/share/doc")
    out, total = [], 0
    if not root.is_dir():
        return out
    for p in sorted(root.rglob("*")):
        n = p.name.lower()
        if not p.is_file() or n.startswith(("copyright", "changelog", "changes", "news", "license")):
            continue
        if not (n.startswith(("readme", "todo", "faq", "install", "howto", "bugs", "thanks", "authors")) or
                n.endswith((".md", ".txt", ".rst", ".md.gz", ".txt.gz"))):
            continue
        try:
            raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if 200 <= len(text) <= WIDE_MAX_FILE:
            out.append((str(p.relative_to(root)), text))
            total += len(text)
            if total >= limit_chars:
                break
    return out


@dataclass
class WideCorpus:
    """The wide corpus split into recovery text and held-out sets (see the comment above)."""
    recovery: dict[str, Corpus]      # "code", "prose"
    heldout: dict[str, Corpus]       # "code", "code-packages", "prose", "prose-man"
    sources: dict[str, int]          # characters per source, for the record

    def describe(self) -> dict:
        return {"recover.corpus": "wide", "recover.sources": [f"{k}:{v}" for k, v in sorted(self.sources.items())],
                "recover.digest": hashlib.sha256("".join(c.digest() for c in self.recovery.values()).encode())
                .hexdigest(),
                "heldout.sets": [f"{k}:{len(c.items)}" for k, c in sorted(self.heldout.items())]}


def wide_corpus(max_chars: int = 24_000_000) -> WideCorpus:
    """Build the wide corpus (deterministic for one machine's installed files; a few seconds)."""
    seen: set[str] = set()

    def fresh(text: str) -> bool:
        h = hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()
        if h in seen:
            return False
        seen.add(h)
        return True

    # held-out sets first, so their texts never enter recovery
    held = corpora("heldout")
    for c in held.values():
        for _, t in c.items:
            fresh(t)
    for c in corpora("calibration").values():  # calibration text is already in recovery's own split
        for _, t in c.items:
            fresh(t)
    pk = _package_units()
    held_pk = Corpus("code", "heldout", [(n, t) for name in sorted(pk) if held_out_package(name)
                                         for kind, n, t in pk[name] if kind == "code" and fresh(t)])
    man = Corpus("prose", "heldout", [(n, t) for n, t in _man_units(2_000_000) if fresh(t)])
    heldout = {"code": held["code"], "code-packages": held_pk, "prose": held["prose"], "prose-man": man}

    budget = {"code": max_chars // 2, "prose": max_chars // 2}
    rec = {"code": Corpus("code", "recovery", list(corpora("calibration")["code"].items)),
           "prose": Corpus("prose", "recovery", list(corpora("calibration")["prose"].items))}
    sources = {"stdlib-calibration": rec["code"].n_chars, "pydoc": rec["prose"].n_chars}

    def add(kind: str, items, share: float = 1.0) -> None:
        cap = budget[kind] * share
        for source, n, t in items:
            if rec[kind].n_chars >= cap:
                return
            if fresh(t):
                rec[kind].items.append((n, t))
                sources[source] = sources.get(source, 0) + len(t)

    # interleave sources and packages, so a budget cut drops a little of each, not whole sources
    def per_package(kind: str) -> list[list[tuple[str, str, str]]]:
        return [[("packages", n, t) for k, n, t in pk[name] if k == kind]
                for name in sorted(pk) if not held_out_package(name)]

    # the standard library beyond the fixed lists and Debian's documentation take up to half their budget first
    add("code", _round_robin(*_by_top([("stdlib", n, t) for n, t in _stdlib_units()])), share=0.5)
    add("code", _round_robin(*per_package("code")))
    add("prose", _round_robin(*_by_top([("debian", n, t) for n, t in _debian_units(budget["prose"])], sep="/")),
        share=0.5)
    add("prose", _round_robin(*per_package("prose")))
    return WideCorpus(rec, heldout, sources)


def _by_top(items: list[tuple[str, str, str]], sep: str = ".") -> list[list[tuple[str, str, str]]]:
    """Group (source, name, text) items by the first part of the name (package, module tree)."""
    groups: dict[str, list] = {}
    for it in items:
        groups.setdefault(it[1].split(sep, 1)[0], []).append(it)
    return [groups[k] for k in sorted(groups)]


def _round_robin(*lists):
    its = [iter(x) for x in lists]
    while its:
        for it in list(its):
            try:
                yield next(it)
            except StopIteration:
                its.remove(it)


def dir_digest(path: str | Path) -> str:
    """SHA-256 over the names and contents of the text files under a folder (a --calib-dir's identity)."""
    h = hashlib.sha256()
    for name, text in dir_items(path):
        h.update(name.encode() + b"\0" + text.encode("utf-8") + b"\0")
    return h.hexdigest()


def dir_items(path: str | Path) -> list[tuple[str, str]]:
    """The UTF-8 text files under a folder (recursively, sorted), as (relative name, text)."""
    root = Path(path)
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts):
            text = _read(p)
            if text:
                out.append((str(p.relative_to(root)), text))
    return out
