"""The one-line file header that starts an editor's completion prompt, e.g. "# parser.py", where
a prefix prompt ends (`heal_split`), and the grammar that makes the answer start with what was cut
(`heal_grammar`).

The language server puts both in its prompts, and the tuner in its editor-shaped samples, so that an
adapter learns from the same layout it is asked with.
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


def heal_split(before: str, line_prefix: str, line_suffix: str = "") -> tuple[str, str]:
    """(prompt text, heal) for a prefix prompt whose text before the cursor is `before`: with the
    cursor on a line of indentation only (`line_prefix`, nothing but whitespace after it), the
    prompt is cut back to the end of the line above and the answer must start with the cut text.

    A prompt that ends in the middle of a whitespace run is one the model never saw in training:
    BPE vocabularies write a line break and its indentation as one or two tokens that end where
    the code starts (SmolLM2: "\\n       " then " return" for eight spaces), so after "\\n" and
    eight spaces as their own tokens the likeliest next token is another space or a line break,
    not code (0 of 80 held-out lines right, bench/nextline.py). Cut at the line break, the model
    writes the break and the indentation its own way, and what follows them is the answer (token
    healing). Fill-in-the-middle prompts are left alone: those models are trained on cuts anywhere.
    """
    if not line_prefix or line_prefix.strip() or line_suffix.strip() or not before.endswith("\n" + line_prefix):
        return before, ""
    return before[:-len(line_prefix) - 1], "\n" + line_prefix


def heal_grammar(heal: str) -> str:
    """The GBNF grammar of an answer to a healed prompt: the `heal` text first (written in whatever
    tokens the model likes: the grammar's matcher reads token texts byte by byte),
    then a character other than whitespace, then anything.

    Without it the model is free to break the line and indent as it likes, and the cursor's
    indentation, cut from the prompt, is lost: SmolLM2-135M wrote another indentation, a blank line
    or the line above's continuation at 54 of 116 indented cursors of held-out code, and its text was
    thrown away (nothing to show at that cursor); held to the heal alone, it wrote more spaces after
    it at 21 of the 116. Constrained, the answer starts where the cursor is, as in training, where the text
    after the cursor is the line break, the indentation and the code (tune/samples.py).
    """
    lit = "".join(_GBNF_ESCAPES.get(c, c) for c in heal)
    return f'root ::= "{lit}" [^ \\t\\r\\n] [^\\x00]*'


_GBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
