"""Completion prompts, built from token ids with the stable part first.

Layout, oldest and most stable first, so the runtime's KV prefix reuse covers all but the last few
tokens while the user types:

    [context chunks from other files]  changes only when the window moves
    [file header]                      one comment line naming the file
    [window of the current file]       starts at a line boundary that stays put while typing
    <cursor>

Fill-in-the-middle models get `<fim_pre> chunks header window <fim_suf> suffix <fim_mid>` built from
their special token ids (llama-cpp-python's `suffix=` path is not used). Every piece of document
text is tokenized with special-token parsing off, so a file that contains "<|endoftext|>" cannot
inject control tokens.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .documents import Cursor, safe_text

#: Line comment per LSP language id, for the file header and the context chunks' captions.
COMMENT = {
    "python": "#", "shellscript": "#", "ruby": "#", "perl": "#", "r": "#", "yaml": "#", "toml": "#",
    "dockerfile": "#", "makefile": "#", "cmake": "#", "julia": "#", "elixir": "#", "nim": "#",
    "lua": "--", "sql": "--", "haskell": "--", "ada": "--",
    "vim": '"', "tex": "%", "latex": "%", "matlab": "%", "erlang": "%", "lisp": ";", "clojure": ";",
}
CHARS_PER_TOKEN = 3.2   # a cautious estimate for code; the real count is taken after tokenizing
BLOCK_OPENERS = (":", "{", "=>", " do", " then")
CLOSERS = set(")]}\"'`;,")


def comment_for(language_id: str) -> str:
    return COMMENT.get(language_id, "//")


def is_multiline(cur: Cursor) -> bool:
    """Multi-line at an empty line or after a block opener at the end of a line; single-line in the
    middle of a line or after ordinary text."""
    rest = cur.line_suffix.strip()
    if rest and not set(rest) <= CLOSERS:
        return False
    before = cur.line_prefix
    if not before.strip():
        return True
    return before.rstrip().endswith(BLOCK_OPENERS) and not rest


@dataclass
class FimIds:
    pre: int
    suf: int
    mid: int
    sep: int = -1     # file separator for repository-level context, when the model has one

    @classmethod
    def of(cls, vocab) -> FimIds | None:
        st = vocab.special_tokens()
        if min(st["fim_pre"], st["fim_suf"], st["fim_mid"]) < 0:
            return None
        return cls(st["fim_pre"], st["fim_suf"], st["fim_mid"], st.get("fim_sep", -1))


@dataclass
class Prompt:
    tokens: list[int]
    mode: str                    # "fim" or "prefix"
    multiline: bool
    anchor: int                  # document offset where the window starts
    window_tokens: int
    context_files: list[str] = field(default_factory=list)


class PromptBuilder:
    """Builds prompts for one loaded model; keeps no per-document state (the anchor is passed in)."""

    def __init__(self, vocab):
        self.vocab = vocab
        self.fim = FimIds.of(vocab)

    def tok(self, text: str) -> list[int]:
        return self.vocab.tokenize(safe_text(text), add_bos=False, special=False) if text else []

    def choose_anchor(self, cur: Cursor, prev: int | None, budget: int) -> tuple[int, list[int]]:
        """Window start (a line start) and the window's tokens. The previous anchor is kept while the
        window fits the budget, so the prompt only grows at its end; when it no longer fits the
        window restarts at about 60% of the budget, leaving room to type before the next move."""
        text, base = cur.prefix, cur.prefix_start
        if prev is not None and base <= prev <= cur.offset and (prev == 0 or text[prev - base - 1:prev - base] == "\n"):
            toks = self.tok(text[prev - base:])
            if len(toks) <= budget:
                return prev, toks
        line_start = max(0, len(text) - len(cur.line_prefix))
        start = max(0, len(text) - int(budget * 0.6 * CHARS_PER_TOKEN))
        if start > 0:
            nl = text.find("\n", start - 1)
            start = min(nl + 1 if nl >= 0 else len(text), line_start)
        toks = self.tok(text[start:])
        while len(toks) > budget and start < len(text):
            nl = text.find("\n", start)
            start = nl + 1 if nl >= 0 else len(text)
            toks = self.tok(text[start:])
        if len(toks) > budget:  # a single enormous line: keep its last `budget` tokens
            toks = toks[-budget:]
        return base + start, toks

    def header(self, cur: Cursor) -> str:
        name = os.path.basename(cur.uri.split("?", 1)[0]) or "untitled"
        return f"{comment_for(cur.language_id)} {name}\n"

    def build(self, cur: Cursor, *, anchor: int | None, context_block: str, budget: int,
              suffix_tokens: int, use_fim: bool, context_files: list[str] | None = None) -> Prompt:
        anchor, window = self.choose_anchor(cur, anchor, budget)
        multiline = is_multiline(cur)
        head = self.tok(context_block + self.header(cur)) if context_block else self.tok(self.header(cur))
        bos = [self.vocab.bos] if self.vocab.add_bos and self.vocab.bos >= 0 else []
        if use_fim and self.fim is not None:
            stoks = self.tok(cur.suffix[:suffix_tokens * 8])[:suffix_tokens]
            tokens = bos + [self.fim.pre] + head + window + [self.fim.suf] + stoks + [self.fim.mid]
            mode = "fim"
        else:
            # tokenized as one string so that the text typed at the end changes only the last tokens
            tokens = bos + self.tok((context_block + self.header(cur)) + cur.prefix[anchor - cur.prefix_start:])
            if len(tokens) > len(bos) + len(head) + len(window) + 8:  # window cut inside one long line
                tokens = bos + head + window
            mode = "prefix"
        return Prompt(tokens, mode, multiline, anchor, len(window), context_files or [])
