"""Completion prompts, with the stable part first.

Layout, oldest and most stable first, so the runtime's KV prefix reuse covers all but the last few
tokens while the user types:

    [context chunks from other files]  changes only when the window moves
    [file header]                      one comment line naming the file
    [window of the current file]       starts at a line boundary that stays put while typing
    <cursor>

This module chooses the window (its anchor stays put while it fits the token budget) and says what
goes in; the model builds the prompt. Fill-in-the-middle models get an InfillPrompt (the chunks, the
header and window as its prefix, the text after the cursor as its suffix), which the local engine
lays out as `<fim_pre> chunks header window <fim_suf> suffix <fim_mid>` (runtime/fim.py) and a
remote one sends to the server's /infill. Other models get the same text as a TextPrompt to
continue. Document text is never parsed for special tokens, so a file that contains
"<|endoftext|>" cannot inject control tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..runtime.codeheader import file_header, heal_grammar, heal_split
from ..runtime.requests import ContextChunk, InfillPrompt, TextPrompt
from .documents import Cursor, safe_text

CHARS_PER_TOKEN = 3.2   # a cautious estimate for code; the real count is taken after tokenizing
BLOCK_OPENERS = (":", "{", "=>", " do", " then")
CLOSERS = set(")]}\"'`;,")


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
class Prompt:
    sent: TextPrompt | InfillPrompt   # what the model gets
    mode: str                    # "fim" or "prefix"
    multiline: bool
    anchor: int                  # document offset where the window starts
    window_tokens: int
    context_files: list[str] = field(default_factory=list)
    #: text cut from the end of a prefix prompt that the answer must start with (runtime/codeheader.py `heal_split`)
    heal: str = ""

    @property
    def grammar(self) -> str | None:
        """The GBNF grammar a healed prompt's answer is sampled with (codeheader.heal_grammar): it starts
        with the heal and then code, at the cursor. None for a prompt that was not cut."""
        return heal_grammar(self.heal) if self.heal else None


class PromptBuilder:
    """Builds prompts for one loaded model; keeps no per-document state (the anchor is passed in)."""

    def __init__(self, model):
        self.model = model
        #: the model reads fill-in-the-middle prompts as such (else it continues the prefix)
        self.fim = model.supports_fim

    def count(self, text: str) -> int:
        """Tokens of document text, for the budgets (an estimate on a remote model: no network
        call, as this runs on the event loop)."""
        if not text:
            return 0
        return self.model.count_tokens(TextPrompt(safe_text(text), add_bos=False, parse_special=False), exact=False)

    def choose_anchor(self, cur: Cursor, prev: int | None, budget: int) -> tuple[int, int]:
        """Window start (a line start) and the window's tokens. The previous anchor is kept while the
        window fits the budget, so the prompt only grows at its end; when it no longer fits the
        window restarts at about 60% of the budget, leaving room to type before the next move."""
        text, base = cur.prefix, cur.prefix_start
        if prev is not None and base <= prev <= cur.offset and (prev == 0 or text[prev - base - 1:prev - base] == "\n"):
            n = self.count(text[prev - base:])
            if n <= budget:
                return prev, n
        line_start = max(0, len(text) - len(cur.line_prefix))
        start = max(0, len(text) - int(budget * 0.6 * CHARS_PER_TOKEN))
        if start > 0:
            nl = text.find("\n", start - 1)
            start = min(nl + 1 if nl >= 0 else len(text), line_start)
        n = self.count(text[start:])
        while n > budget and start < len(text):   # whole lines off the start until it fits
            nl = text.find("\n", start)
            start = nl + 1 if nl >= 0 else len(text)
            n = self.count(text[start:])
        return base + start, n

    def header(self, cur: Cursor) -> str:
        return file_header(cur.uri, cur.language_id)

    def suffix(self, text: str, n_tokens: int) -> str:
        """The start of `text` that takes at most about `n_tokens` tokens."""
        text = text[:n_tokens * 8]
        for _ in range(4):   # a few proportional cuts: the count is known after each
            n = self.count(text)
            if n <= n_tokens:
                break
            text = text[:len(text) * n_tokens // n]
        return text

    def build(self, cur: Cursor, *, anchor: int | None, context_block: str, budget: int,
              suffix_tokens: int, use_fim: bool, context_files: list[str] | None = None) -> Prompt:
        anchor, n_window = self.choose_anchor(cur, anchor, budget)
        multiline = is_multiline(cur)
        head = self.header(cur) + cur.prefix[anchor - cur.prefix_start:]
        heal = ""
        if use_fim and self.fim:
            chunks = (ContextChunk("", safe_text(context_block)),) if context_block else ()
            sent: TextPrompt | InfillPrompt = InfillPrompt(
                safe_text(head), safe_text(self.suffix(cur.suffix, suffix_tokens)) if suffix_tokens else "",
                chunks=chunks)
            mode = "fim"
        else:
            # one text, so that the text typed at the end changes only the last tokens
            # token healing at a cursor after indentation only (codeheader.heal_split)
            text, heal = heal_split(safe_text(context_block + head), cur.line_prefix, cur.line_suffix)
            sent = TextPrompt(text, parse_special=False)
            mode = "prefix"
        return Prompt(sent, mode, multiline, anchor, n_window, context_files or [], heal)
