"""The one-line file header that starts an editor's completion prompt, e.g. "# parser.py".

The language server puts it before the window of the current file, and the tuner puts it before the
text of its editor-shaped samples, so that an adapter learns from the same layout it is asked with.
"""
from __future__ import annotations

import os

#: Line comment per language id (LSP ids and the tuner's language names), for the file header and
#: the context chunks' captions; "//" elsewhere.
COMMENT = {
    "python": "#", "shellscript": "#", "shell": "#", "ruby": "#", "perl": "#", "r": "#", "yaml": "#",
    "toml": "#", "dockerfile": "#", "makefile": "#", "cmake": "#", "julia": "#", "elixir": "#", "nim": "#",
    "lua": "--", "sql": "--", "haskell": "--", "ada": "--",
    "vim": '"', "tex": "%", "latex": "%", "matlab": "%", "erlang": "%", "lisp": ";", "clojure": ";",
}


def comment_for(language_id: str) -> str:
    return COMMENT.get(language_id, "//")


def file_header(path: str, language_id: str) -> str:
    """The header line for a file at `path` (a URI or a path; only its base name is shown)."""
    name = os.path.basename(path.split("?", 1)[0]) or "untitled"
    return f"{comment_for(language_id)} {name}\n"
