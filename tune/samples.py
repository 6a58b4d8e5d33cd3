"""Training samples from source files, laid out the way the editor asks the model.

The language server asks a model that has fill-in-the-middle tokens with runtime/fim.py's layout,

    [BOS] <FIM_PRE> prefix <FIM_SUF> suffix <FIM_MID> middle

and the model ends the middle with its end-of-generation token. A FIM sample here is that layout
with the middle filled in and the end token after it.

A model without the three tokens is asked to continue a prefix, and the editor's prefix is
lsp_server/prompt.py's: a one-line file header ("# parser.py"), a window of the file that starts at
a line start, and the text of the cursor's line before the cursor. A "prefix" sample is that: the
header, a window of lines, and a cursor at the start of one of its lines after the line's
indentation (where an editor's auto-indent leaves it), the prompt and the answer tokenized apart, as
the editor's are. There the server heals the prompt (runtime/codeheader.py `heal_split`): it ends at
the line above, and the answer starts with the line break and the indentation, so the sample is cut
the same way. The header is not learnt (weight 0); everything after it is.

Where the middle is cut: at syntactic boundaries, found from indentation (any language): the middle
starts at the beginning of a line and runs over whole lines up to the end of the statement or block
that starts there (the next line indented no deeper than its first, blank lines aside), or, half of
the time, ends inside that block at the end of a line, as a cursor in the middle of a function would.
Samples alternate between the editor's layout and plain windows (`fim_rate`, as code models are
trained), so the adapter learns the repository's text as well as the editor's layout.

Optionally (`docstring_pairs`), every Python function with a docstring also gives a sample whose
prompt is its signature and docstring (in the editor's layout: a FIM prefix, or the header and the
text before the cursor) and whose target is its body: only the body is learnt (pairs.py).

Each sample is a token window of at most `seq_len` with a weight per target: 1 for tokens learnt,
0 for padding and for the FIM marker tokens (their place is the caller's choice, not the code's).
Everything is seeded: the same files, seed and tokenizer give the same samples.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np

from ..runtime.codeheader import file_header, heal_split
from .collect import SourceFile
from .pairs import docstring_pairs

#: Tokens kept free in a FIM window for the marker tokens, BOS and the end token.
MARKERS = 5


@dataclass(frozen=True)
class Tokenizer:
    """What sample building needs of a model's vocabulary."""

    tokenize: Callable[[str], list[int]]     # text -> ids, special-token parsing off
    bos: int | None                          # prepended when the model adds one
    end: int | None                          # the end-of-generation token after a middle
    fim: tuple[int, int, int] | None         # (prefix, suffix, middle) or None

    @classmethod
    def from_vocab(cls, vocab) -> Tokenizer:
        """From a runtime Vocab (runtime/llama Weights): the same tokens the editor's prompts use."""
        from ..runtime.fim import fim_ids

        st = vocab.special_tokens()
        end = st.get("eot", -1)
        end = end if end is not None and end >= 0 else st.get("eos", -1)
        return cls(lambda t: vocab.tokenize(t, add_bos=False, special=False),
                   vocab.bos if vocab.add_bos and vocab.bos >= 0 else None,
                   end if end is not None and end >= 0 else None, fim_ids(vocab))


@dataclass
class Samples:
    tokens: np.ndarray    # (N, seq_len) int64
    weights: np.ndarray   # (N, seq_len) float32: weight of predicting tokens[:, t + 1] at t; last column 0
    kinds: list[str]      # "fim", "prefix", "plain" or "pair" per row

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def targets(self) -> int:
        return int(self.weights.sum())


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def block_end(lines: list[str], start: int) -> int:
    """The line after the statement or block that begins at `lines[start]` (module docstring)."""
    base = _indent(lines[start])
    i = start + 1
    while i < len(lines):
        s = lines[i]
        if s.strip() and _indent(s) <= base and not s.lstrip().startswith((")", "]", "}")):
            break
        i += 1
    while i - 1 > start and not lines[i - 1].strip():   # trailing blank lines stay outside the middle
        i -= 1
    return i


def _windows(lines: list[str], counts: list[int], room: int) -> list[tuple[int, int]]:
    """Line ranges [a, b) whose token counts fit `room`, covering the file in order."""
    out, a = [], 0
    while a < len(lines):
        b, used = a, 0
        while b < len(lines) and (used + counts[b] <= room or b == a):
            used += counts[b]
            b += 1
        out.append((a, b))
        a = b
    return out


class Builder:
    def __init__(self, tok: Tokenizer, seq_len: int, fim_rate: float = 0.5, seed: int = 0,
                 pairs: bool = False):
        self.tok, self.seq_len, self.seed, self.pairs = tok, seq_len, seed, pairs
        self.fim_rate = fim_rate
        self._lines: dict[str, int] = {}   # token count of each distinct line, over all epochs

    @property
    def layout(self) -> str:
        """The editor's layout for this model: "fim" with FIM tokens, "prefix" without."""
        return "fim" if self.tok.fim is not None else "prefix"

    def _ids(self, text: str) -> list[int]:
        return self.tok.tokenize(text) if text else []

    def _count(self, line: str) -> int:
        n = self._lines.get(line)
        if n is None:
            n = self._lines[line] = len(self._ids(line))
        return n

    def plain(self, ids: list[int]) -> list[tuple[list[int], list[float]]]:
        """Next-token windows of a file's ids (each starts with BOS where the model uses one)."""
        bos = [] if self.tok.bos is None else [self.tok.bos]
        step = self.seq_len - len(bos)
        out = []
        for a in range(0, max(len(ids) - 1, 1), step):
            w = bos + ids[a:a + step]
            if len(w) >= 2:
                out.append((w, [1.0] * (len(w) - 1)))
        return out

    def fim(self, lines: list[str], rng: random.Random) -> tuple[list[int], list[float]] | None:
        """One FIM sample from a window of lines, cut at a syntactic boundary."""
        starts = [i for i, s in enumerate(lines) if s.strip()]
        if len(starts) < 2:
            return None
        a = rng.choice(starts)
        b = block_end(lines, a)
        if rng.random() < 0.5 and b - a > 1:   # a cursor inside the block: the middle ends at a line end
            b = rng.randrange(a + 1, b + 1)
        return self.fim_ids("".join(lines[:a]), "".join(lines[a:b]), "".join(lines[b:]))

    def fim_ids(self, prefix: str, middle: str, suffix: str, learn_prefix: bool = True):
        """The FIM layout of (prefix, middle, suffix), with the end token after the middle."""
        pre_t, suf_t, fim_mid = self.tok.fim
        bos = [] if self.tok.bos is None else [self.tok.bos]
        end = [] if self.tok.end is None else [self.tok.end]
        p, m, s = self._ids(prefix), self._ids(middle) + end, self._ids(suffix)
        room = self.seq_len - len(bos) - 3
        m = m[:room]
        s = s[:max(0, (room - len(m)) // 2)] if len(p) + len(s) + len(m) > room else s
        p = p[-(room - len(m) - len(s)):] if room - len(m) - len(s) > 0 else []
        ids = bos + [pre_t] + p + [suf_t] + s + [fim_mid] + m
        markers = {pre_t, suf_t, fim_mid}
        first = len(ids) - len(m) - 1   # the target ids[t + 1] is the middle's from here
        # weight of the target ids[t + 1]: the markers are not learnt, everything else is
        w = [0.0 if ids[t + 1] in markers or (not learn_prefix and t < first) else 1.0
             for t in range(len(ids) - 1)]
        return ids, w

    def prefix(self, lines: list[str], header: str, rng: random.Random) -> tuple[list[int], list[float]] | None:
        """One sample in the editor's prefix layout: a cursor after the indentation of a line."""
        starts = [i for i, s in enumerate(lines) if s.strip() and i > 0]
        if not starts:
            return None
        c = rng.choice(starts)
        ind = lines[c][:_indent(lines[c])]
        before, heal = heal_split("".join(lines[:c]) + ind, ind)   # as the server cuts its prompt
        return self.prefix_ids(header, before, heal + "".join(lines[c:])[len(ind):])

    def prefix_ids(self, header: str, before: str, after: str, learn_before: bool = True):
        """Header + text before the cursor, then the text after it, each tokenized on its own; the
        end of `after` goes where the window is full. None when `before` leaves no room."""
        bos = [] if self.tok.bos is None else [self.tok.bos]
        h, b = bos + self._ids(header), self._ids(before)
        room = self.seq_len - len(h) - len(b)
        if room < 2:
            return None
        ids = h + b + self._ids(after)[:room]
        learnt = len(h) - 1 if learn_before else len(h) + len(b) - 1
        return ids, [0.0 if t < learnt else 1.0 for t in range(len(ids) - 1)]

    def build(self, files: list[SourceFile], epoch: int = 0) -> Samples:
        rows: list[tuple[list[int], list[float]]] = []
        kinds: list[str] = []
        for fi, f in enumerate(files):
            rng = random.Random(f"{self.seed}:{epoch}:{fi}:{f.path}")
            header = file_header(f.path, f.language)
            if self.pairs:
                for got in docstring_pairs(f, self, header):
                    rows.append(got)
                    kinds.append("pair")
            if self.fim_rate <= 0:
                got = self.plain(self._ids(f.text))
                rows += got
                kinds += ["plain"] * len(got)
                continue
            lines = f.text.splitlines(keepends=True)
            counts = [self._count(s) for s in lines]
            room = self.seq_len - (MARKERS if self.layout == "fim" else self._count(header) + 1)
            for a, b in _windows(lines, counts, room):
                win = lines[a:b]
                sample = None
                if rng.random() < self.fim_rate:
                    sample = self.fim(win, rng) if self.layout == "fim" else self.prefix(win, header, rng)
                if sample is None:
                    got = self.plain(self._ids("".join(win)))[:1]
                    rows += got
                    kinds += ["plain"] * len(got)
                else:
                    rows.append(sample)
                    kinds.append(self.layout)
        return pack(rows, kinds, self.seq_len)


def pack(rows: list[tuple[list[int], list[float]]], kinds: list[str], seq_len: int) -> Samples:
    n = len(rows)
    tokens = np.zeros((n, seq_len), dtype=np.int64)
    weights = np.zeros((n, seq_len), dtype=np.float32)
    for i, (ids, w) in enumerate(rows):
        ids, w = ids[:seq_len], w[:seq_len - 1]
        tokens[i, :len(ids)] = ids
        weights[i, :len(w)] = w
    return Samples(tokens, weights, kinds)
