"""Every relative link in README.md and docs/*.md points at a file that exists and, with a `#part`,
at a heading (GitHub's anchor for it) or an explicit `<a id=...>` in that file."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but '-' and '_' removed,
    spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]|<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set(_ID.findall(text))
    for heading in _HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(paths: list[Path], root: Path = ROOT) -> list[str]:
    bad = []
    for doc in paths:
        for target in _LINK.findall(_prose(doc.read_text(encoding="utf-8"))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
                continue   # http:, https:, mailto: ...
            file, _, part = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(root)}: {target} (no such file)")
            elif part and dest.suffix == ".md" and part not in anchors(dest):
                bad.append(f"{doc.relative_to(root)}: {target} (no such heading)")
    return bad


def test_slugs_follow_github():
    assert slug("GPU (CUDA)") == "gpu-cuda"
    assert slug("`a3b serve` and remote models") == "a3b-serve-and-remote-models"
    assert slug("Over 400 held-out lines, and two more packages") == "over-400-held-out-lines-and-two-more-packages"


def test_the_checker_finds_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n[ok](#top) [file](b.md#x) [gone](c.md) `[code](d.md)`\n")
    (tmp_path / "b.md").write_text("# Y\n")
    found = broken_links([tmp_path / "a.md"], root=tmp_path)
    assert found == ["a.md: b.md#x (no such heading)", "a.md: c.md (no such file)"]


def test_relative_links_in_the_docs_resolve():
    bad = broken_links(DOCS)
    assert not bad, "broken links:\n  " + "\n  ".join(bad)
