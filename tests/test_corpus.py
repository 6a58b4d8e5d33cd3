"""Corpus windows and the wide recovery corpus (no torch, no model)."""
from __future__ import annotations

import hashlib
import zlib

import pytest

from comfyui_a3b.prune import corpus, wide


def _word_tokens(text: str) -> list[int]:
    """A tokenizer whose last token changes when a word is cut: ids are hashes of whole words."""
    return [zlib.crc32(w.encode()) for w in text.split()]


def _all_windows(c: corpus.Corpus, seq_len: int, n: int, bos) -> list[list[int]]:
    body = seq_len - (1 if bos is not None else 0)
    per = []
    for _, text in c.items:
        t = _word_tokens(text)
        per.append([t[i:i + body] for i in range(0, len(t) - body + 1, body)])
    out, depth = [], 0
    while len(out) < n and any(depth < len(w) for w in per):
        for ws in per:
            if depth < len(ws) and len(out) < n:
                out.append(([bos] if bos is not None else []) + ws[depth])
        depth += 1
    return out


@pytest.mark.parametrize("n", [1, 5, 40, 10_000, 1 << 30])
@pytest.mark.parametrize("bos", [None, 7])
def test_windows_from_prefixes_are_the_whole_texts_windows(n, bos):
    words = [f"w{i % 997}x{i % 13}" for i in range(20_000)]
    c = corpus.Corpus("code", "calibration", [("a", " ".join(words[:9000])), ("b", " ".join(words[5000:5300])),
                                              ("c", " ".join(words[100:20_000]))])
    calls = []

    def tok(text):
        calls.append(len(text))
        return _word_tokens(text)
    assert corpus.windows(tok, c, 64, n, bos) == _all_windows(c, 64, n, bos)
    if n == 5:  # a few windows: only prefixes were read
        assert sum(calls) < c.n_chars / 4


@pytest.mark.slow
def test_wide_corpus_keeps_held_out_sources_out_of_recovery():
    w = wide.wide_corpus(max_chars=4_000_000)
    digest = {hashlib.sha256(t.encode()).hexdigest() for c in w.recovery.values() for _, t in c.items}
    for name, c in w.heldout.items():
        assert c.items, name
        assert not digest & {hashlib.sha256(t.encode()).hexdigest() for _, t in c.items}, name
    names = [n for c in w.recovery.values() for n, _ in c.items]
    assert not [n for n in names if n.startswith("pydoc_data")]
    held_topics = {t for _, t in corpus.corpora("heldout")["prose"].items}
    assert not any(t in text for text in (x for c in w.recovery.values() for _, x in c.items) for t in held_topics)
    held_pk = {n.split("/", 1)[0] for n, _ in w.heldout["code-packages"].items}
    assert held_pk and not held_pk & {n.split("/", 1)[0] for n, _ in w.recovery["code"].items}
