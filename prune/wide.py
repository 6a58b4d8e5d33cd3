"""The wide corpus: what a machine has without a download, for recovery and held-out measures.

Recovery learns from the teacher's distribution on text, so more and more varied text helps it more
than more passes over the same text (measured: 40x the tokens on the calibration corpus stalled,
adding other code moved held-out code). Sources, each read only as training signal or measure:

- stdlib:   the standard library's modules beyond the calibration and held-out lists (code);
- packages: the sources of every installed distribution (code) and their documentation files (prose),
            one unit per top-level package; a fixed tenth of the packages (by a hash of the name) is
            held out whole;
- pydoc:    the language reference topics (prose; the held-out topics stay held out);
- debian:   /usr/share/doc (READMEs, guides; not copyright files or changelogs) (prose);
- man:      English manual pages (prose), held out whole: it is prose from another source than any
            text calibration or recovery reads.
Texts are deduplicated by content (vendored copies); held-out units never enter the recovery split.
"""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .corpus import CALIBRATION_MODULES, HELDOUT_MODULES, Corpus, corpora
from .textfiles import MAX_FILE, read_text

HELDOUT_PACKAGE_MOD = 10         # packages with sha256(name) % 10 == 0 are held out


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
        text = read_text(p)
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
                text = read_text(p)
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


def man_units(limit_chars: int) -> list[tuple[str, str]]:
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
        if 200 <= len(text) <= MAX_FILE:
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
    man = Corpus("prose", "heldout", [(n, t) for n, t in man_units(2_000_000) if fresh(t)])
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


