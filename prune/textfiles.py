"""Text files read as corpus text: one file (UTF-8, not binary, not huge), or every such file under a
folder (a --calib-dir) and its digest, which names the folder's text in cache keys."""
from __future__ import annotations

import hashlib
from pathlib import Path

#: characters; larger files are generated data more often than not
MAX_FILE = 400_000


def read_text(path: Path) -> str | None:
    """The UTF-8 text of `path`, or None for a file that cannot be read, is binary, shorter than 64 or
    longer than MAX_FILE characters."""
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
    return text if 64 <= len(text) <= MAX_FILE else None


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
            text = read_text(p)
            if text:
                out.append((str(p.relative_to(root)), text))
    return out
