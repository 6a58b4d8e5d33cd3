"""Quick fixes and explanations: prompts, traceback parsing, and turning answers into edits.

The code action itself only names the fix (cheap); the model runs when the client resolves the
action (or executes the fallback command), with the offending lines and the problem in a chat
prompt. The answer's code replaces exactly those lines.

Tracebacks come from user text (a selection, the lines around the cursor), so every pattern here is
linear in its input: a frame line's leading blanks are spaces or tabs only (a \\s* at each line start
would run over every blank line that follows, quadratic in their number), a path stops at the line's
end, and a traceback is read at most MAX_TRACEBACK_CHARS past its header.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

FRAME = re.compile(r'^[ \t]*File "(?P<path>[^"\n]+)", line (?P<line>\d+)', re.M)
ERROR_LINE = re.compile(r"[\w.]+(?:Error|Exception|Exit|Interrupt|Warning)\b")
TRACEBACK_START = "Traceback (most recent call last):"
#: a traceback of a thousand frames is about 200 KB; Python folds longer runs of repeated frames
MAX_TRACEBACK_CHARS = 256 * 1024
FENCE = re.compile(r"```[\w+-]*\n(.*?)(?:```|\Z)", re.S)
CONTEXT_LINES = 2

FIX_SYSTEM = ("You are a careful programmer. You get a few lines of code and a problem report. "
              "Reply with the corrected lines only, in one fenced code block, same indentation, "
              "nothing else.")
EXPLAIN_SYSTEM = "You explain code to a colleague in two or three plain sentences."


@dataclass
class Frame:
    path: str
    line: int          # 1-based, as printed


@dataclass
class Traceback:
    frames: list[Frame]
    error: str         # the last line, e.g. "ZeroDivisionError: division by zero"


def traceback_excerpt(text: str) -> str | None:
    """`text` from its first traceback header on, at most MAX_TRACEBACK_CHARS; None without one."""
    i = text.find(TRACEBACK_START)
    return None if i < 0 else text[i:i + MAX_TRACEBACK_CHARS]


def parse_traceback(text: str) -> Traceback | None:
    """The frames and final error line of a Python traceback inside `text`, or None."""
    body = traceback_excerpt(text)
    if body is None:
        return None
    frames = [Frame(m.group("path"), int(m.group("line"))) for m in FRAME.finditer(body)]
    if not frames:
        return None
    lines = [ln.strip() for ln in body.splitlines() if ln.strip()]
    error = next((ln for ln in reversed(lines) if ERROR_LINE.match(ln)
                  or (":" in ln and not ln.startswith(("File ", "Traceback", "^", "~")))), lines[-1])
    return Traceback(frames, error)


def uri_to_path(uri: str) -> str | None:
    p = urlparse(uri)
    if p.scheme != "file":
        return None
    return unquote(p.path)


def fix_messages(code: str, problem: str, language: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": FIX_SYSTEM},
            {"role": "user", "content": f"Problem: {problem}\n\n```{language}\n{code}\n```\n\nCorrected lines:"}]


def explain_messages(code: str, language: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": EXPLAIN_SYSTEM},
            {"role": "user", "content": f"What does this {language or 'code'} do?\n\n```{language}\n{code}\n```"}]


def extract_code(answer: str, original: str) -> str:
    """The code of a fenced block in `answer` (or the whole answer), re-indented like `original`."""
    m = FENCE.search(answer)
    code = m.group(1) if m else answer
    code = code.strip("\n").rstrip()
    if not code.strip():
        return ""
    lines = code.split("\n")
    want = _indent(next((ln for ln in original.split("\n") if ln.strip()), ""))
    have = _indent(next((ln for ln in lines if ln.strip()), ""))
    if have != want:  # small models often drop the indentation of an excerpt
        lines = [want + ln[len(have):] if ln.strip() and ln.startswith(have) else ln for ln in lines]
    return "\n".join(lines)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def line_window(text: str, first: int, last: int, around: int = CONTEXT_LINES) -> tuple[int, int, str]:
    """Lines first-around..last+around (0-based, inclusive) of `text`: (start line, end line, text)."""
    lines = text.split("\n")
    a = max(0, first - around)
    b = min(len(lines) - 1, last + around)
    return a, b, "\n".join(lines[a:b + 1])


def read_source(path: str, roots: list[str]) -> str | None:
    """A file named by a traceback, only if it lies inside one of the workspace folders."""
    try:
        p = Path(path).resolve()
    except OSError:
        return None
    for r in roots:
        try:
            p.relative_to(Path(r).resolve())
        except ValueError:
            continue
        if p.is_file() and p.stat().st_size < 4 << 20:
            return p.read_text(encoding="utf-8", errors="replace")
    return None
