"""Turning raw model text into a suggestion an editor can show.

The rules answer the usual complaints about local completion: suggestions that repeat the code
below the cursor, that duplicate the closing bracket already on the line, that run past the end of
the block, or that come with broken indentation.
"""
from __future__ import annotations

import re

from .documents import Cursor

_WORD = re.compile(r"\w*")


def word_before(text: str) -> str:
    """The run of word characters that ends `text`: what `\\w*$` finds, but matched on the reversed
    text. A search for `\\w*$` starts at every position of the run and scans to its end from each:
    quadratic in the run's length (a 20,000-character run took 2.5 s)."""
    n = _WORD.match(text[::-1]).end()
    return text[len(text) - n:]


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def next_lines(cur: Cursor, n: int = 3) -> list[str]:
    """The next `n` non-empty lines after the current one."""
    rest = cur.suffix.split("\n")[1:]
    return [ln.rstrip("\r") for ln in rest if ln.strip()][:n]


def trim_overlap(text: str, line_suffix: str) -> str:
    """Drop the end of `text` that the rest of the line already contains (e.g. a closing bracket)."""
    rest = line_suffix.rstrip()
    if not rest:
        return text
    for k in range(min(len(text), len(rest)), 0, -1):
        if text.endswith(rest[:k]):
            return text[:-k]
    return text


def block_end(text: str, cur: Cursor) -> int | None:
    """Index in `text` where a multi-line completion leaves the block it started in, or None.

    The block's indentation is that of the first non-empty line the completion writes (on the
    cursor's line when the cursor stands on an empty line, else the first line after it); a later
    non-empty line indented less ends the completion. The last line of `text` counts only once a
    newline ends it, so this also works on text still being generated.
    """
    lines = text.split("\n")
    complete = lines[:-1]
    base = None
    pos = 0
    for i, ln in enumerate(complete):
        full = cur.line_prefix + ln if i == 0 else ln
        opener = i == 0 and not ln.strip() and cur.line_prefix.rstrip().endswith((":", "{"))
        if full.strip() and not opener:
            if base is None:
                if i == 0 and cur.line_prefix.strip():
                    base = indent_of(cur.line_prefix)  # the cursor's line, with code before the cursor
                else:
                    base = indent_of(full)
            elif indent_of(full) < base:
                return max(0, pos - 1)
        pos += len(ln) + 1
    return None


def healed(raw: str, heal: str) -> str | None:
    """The model's text after the `heal` its prompt was cut by (codeheader.heal_split): "" while the
    text has not got past it yet, None once it has written something else there (it continued the
    line above, or indented differently: nothing to show at this cursor)."""
    if not heal or raw.startswith(heal):
        return raw[len(heal):]
    return "" if heal.startswith(raw) else None


def finish(text: str, cur: Cursor, multiline: bool) -> str:
    """The suggestion to show for raw model `text` at `cur`, or "" when nothing is worth showing."""
    text = text.replace("\r\n", "\n")
    if not multiline:
        text = text.split("\n", 1)[0].rstrip()
        text = trim_overlap(text, cur.line_suffix)
        if not text.strip():
            return ""
        if cur.line_suffix.strip() and text.strip() == cur.line_suffix.strip():
            return ""  # the model repeated what follows the cursor
        whole = (cur.line_prefix + text).strip()
        following = next_lines(cur, 1)
        if following and whole == following[0].strip():
            return ""  # the model repeated the next line
        return text
    have = len(cur.line_prefix)
    if have and not cur.line_prefix.strip() and indent_of(text) == have:
        text = text[have:]  # the cursor stands after the indentation: do not indent twice
    cut = block_end(text + "\n", cur)
    if cut is not None:
        text = text[:cut]
    lines = [ln.rstrip() for ln in text.split("\n")]
    following = [ln.strip() for ln in next_lines(cur, 3)]
    if following:
        for i, ln in enumerate(lines):
            s = ln.strip()
            if len(s) > 3 and s == following[0] and (i > 0 or not cur.line_prefix.strip()):
                lines = lines[:i]  # from here on the model repeats the code below the cursor
                break
    while lines and not lines[-1].strip():
        lines.pop()
    out = "\n".join(lines)
    if not out.strip():
        return ""
    return trim_overlap(out, cur.line_suffix) if "\n" not in out else out
