"""A small .gitignore matcher, for folders that are not git work trees (inside one, git lists the files).

The rules of the format that matter for choosing source files: comments and blank lines, `!` to
re-include, a trailing `/` for folders only, a pattern with a `/` anywhere but its end anchored to
its .gitignore's folder (otherwise matched at any depth below it), `*`, `?`, `[...]` and `**`. The
last matching rule wins, and rules of a deeper .gitignore come after those of the folders above it.
Patterns become regular expressions over a path relative to their folder; paths are short, and each
pattern has at most a few wildcards, so matching costs little.
"""
from __future__ import annotations

import re


def _translate(pat: str) -> str:
    """The regular expression of one glob pattern (no anchoring decided here)."""
    out, i, n = [], 0, len(pat)
    while i < n:
        c = pat[i]
        if pat.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pat.startswith("/**", i) and i + 3 == n:
            out.append("/.*")
            i += 3
        elif pat.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = pat.find("]", i + 2 if pat[i + 1:i + 2] in ("!", "]") else i + 1)
            if j < 0:
                out.append(re.escape(c))
                i += 1
                continue
            body = pat[i + 1:j]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = j + 1
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(pat[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


class IgnoreRules:
    def __init__(self) -> None:
        self._rules: list[tuple[str, re.Pattern, bool, bool]] = []   # (base, regex, negated, dirs only)

    def add(self, base: str, text: str) -> None:
        """The rules of the .gitignore file in folder `base` (relative, "" for the root)."""
        for line in text.splitlines():
            line = line.rstrip()
            if not line or line.startswith("#"):
                continue
            neg = line.startswith("!")
            if neg:
                line = line[1:]
            if line.startswith("\\"):
                line = line[1:] if line[1:2] in ("#", "!") else line
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            if not line:
                continue
            anchored = "/" in line
            body = _translate(line.lstrip("/"))
            rx = re.compile(("" if anchored else "(?:.*/)?") + body + r"\Z", re.DOTALL)
            self._rules.append((base, rx, neg, dir_only))

    def ignored(self, rel: str, is_dir: bool = False) -> bool:
        """Whether the path `rel` (relative to the walk's root) is ignored."""
        verdict = False
        for base, rx, neg, dir_only in self._rules:
            if dir_only and not is_dir:
                continue
            if base:
                if not rel.startswith(base + "/"):
                    continue
                sub = rel[len(base) + 1:]
            else:
                sub = rel
            if rx.match(sub):
                verdict = not neg
        return verdict
