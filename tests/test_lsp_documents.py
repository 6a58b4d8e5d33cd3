"""Documents under edits (fast tier): the same text, lines and positions as a plain string would
give, after any sequence of edits; and an edit costs what the edit is, not what the document is."""
from __future__ import annotations

import random
import re
import time

import pytest
from comfyui_a3b.lsp_server.documents import Document
from lsprotocol import types as T

ALPHABET = ["a", "b", " ", "\n", "\r", "\r\n", "é", "😀", "\t", "\x0c"]


def ref_lines(text: str) -> list[str]:
    """The lines of `text` as the LSP counts them (only \\n, \\r\\n and \\r end one)."""
    return re.split(r"\r\n|\r|\n", text)


def ref_units(s: str, encoding: str) -> int:
    if encoding == "utf-32":
        return len(s)
    if encoding == "utf-8":
        return len(s.encode("utf-8"))
    return len(s.encode("utf-16-le")) // 2


def ref_position(text: str, offset: int, encoding: str) -> T.Position:
    lines = ref_lines(text[:offset])
    return T.Position(len(lines) - 1, ref_units(lines[-1], encoding))


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


@pytest.mark.parametrize("encoding", ["utf-16", "utf-8", "utf-32"])
def test_random_edits_keep_text_lines_and_positions_exact(encoding):
    rng = random.Random(encoding)
    for trial in range(40):
        text = random_text(rng, rng.randrange(0, 60))
        doc = Document("file:///r.txt", text)
        if trial % 2:
            doc.line_count()           # line starts kept up to date from here on, not rebuilt
        for _ in range(60):
            a = rng.randrange(0, len(text) + 1)
            b = rng.randrange(a, min(len(text), a + 8) + 1)
            new = random_text(rng, rng.choice([0, 1, 1, 2, 5, 30]))
            if rng.random() < 0.03:
                doc.apply(T.TextDocumentContentChangeWholeDocument(text=new), encoding)
                text = new
                continue
            ra, rb = ref_position(text, a, encoding), ref_position(text, b, encoding)
            if _inside_line_end(text, a) or _inside_line_end(text, b):
                continue   # a position cannot point between \r and \n
            end = doc.apply(T.TextDocumentContentChangePartial(range=T.Range(ra, rb), text=new), encoding)
            text = text[:a] + new + text[b:]
            assert end == a + len(new)
            assert len(doc) == len(text)
            lines = ref_lines(text)
            assert doc.line_count() == len(lines)
            k = rng.randrange(len(lines))
            assert doc.line_text(k) == lines[k]
            off = rng.randrange(0, len(text) + 1)
            if not _inside_line_end(text, off):
                pos = ref_position(text, off, encoding)
                assert doc.position_at(off, encoding) == pos
                assert doc.offset_at(pos, encoding) == off
            i = rng.randrange(0, len(text) + 1)
            assert doc.slice(i, i + 7) == text[i:i + 7]
        assert doc.text == text
        assert doc.snapshot().text() == text


def _inside_line_end(text: str, off: int) -> bool:
    return 0 < off < len(text) and text[off - 1] == "\r" and text[off] == "\n"


def test_text_and_line_starts_stay_exact_over_many_scattered_edits():
    rng = random.Random(7)
    text = "".join(f"line {i}\n" for i in range(2000))
    doc = Document("file:///s.py", text)
    doc.line_count()
    for _ in range(500):     # more edits than MAX_PIECES: the pieces are joined now and then
        line = rng.randrange(doc.line_count() - 1)
        pos = T.Position(line, rng.randrange(4))
        a = doc.offset_at(pos)
        new = "x\n" if rng.random() < 0.3 else "y"
        doc.apply(T.TextDocumentContentChangePartial(range=T.Range(pos, pos), text=new))
        text = text[:a] + new + text[a:]
    assert doc.text == text and doc.line_count() == text.count("\n") + 1


@pytest.mark.parametrize("first", ["a", "é"])
def test_an_insert_on_a_20_mb_line_costs_what_the_insert_is(first):
    """In UTF-16, the default encoding. (A line with characters outside the BMP, or non-ASCII text in
    UTF-8, still converts a position from the line's start: its cost grows with the column.)"""
    doc = Document("file:///big.txt", first + "a" * 20_000_000)
    doc.line_count()
    t0 = time.perf_counter()
    for k in range(100):    # typing near the end of the line, as an editor sends it
        pos = doc.position_at(20_000_001 + k - 10)
        doc.apply(T.TextDocumentContentChangePartial(range=T.Range(pos, pos), text="x"))
    per_edit = (time.perf_counter() - t0) / 100
    # a copy of the 20 MB line alone takes about 10 ms on a busy 2-core machine; before, an insert
    # here cost 140 ms in ASCII and 380 ms with one "é" (the line starts scanned again, the line
    # copied twice and re-encoded)
    assert per_edit < 0.005, per_edit
    assert doc.text[-110:-10] == "x" * 100 and doc.line_count() == 1
