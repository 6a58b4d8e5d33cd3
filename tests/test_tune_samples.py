"""Sample building in the editor's prefix layout (models without FIM tokens) and the optional
docstring -> body pairs for Python (fast tier: a byte tokenizer, no model)."""
from __future__ import annotations

import argparse

import numpy as np

from comfyui_a3b.tune import cli
from comfyui_a3b.tune.collect import SourceFile
from comfyui_a3b.tune.options import TuneConfig
from comfyui_a3b.tune.pairs import functions
from comfyui_a3b.tune.samples import Builder, Tokenizer

PRE, SUF, MID, END = 256, 257, 258, 259
CODE = "".join(f"def f{i}(x):\n    if x:\n        return x * {i}\n    return {i}\n\n" for i in range(6))


def _tok(calls=None, fim=False, bos=None):
    def tokenize(t):
        if calls is not None:
            calls.append(t)
        return list(t.encode())
    return Tokenizer(tokenize, bos, END, (PRE, SUF, MID) if fim else None)


def _text(row, n) -> str:
    return bytes(int(t) for t in row[:n] if t < 256).decode()


def test_prefix_samples_follow_the_editors_prompt_without_fim_tokens():
    calls: list[str] = []
    f = SourceFile("pkg/a.py", "python", CODE)
    s = Builder(_tok(calls, bos=300), seq_len=400, fim_rate=1.0, seed=1).build([f])
    assert s.kinds == ["prefix"]
    n = int((s.weights[0] > 0).sum())
    row, w = s.tokens[0], s.weights[0]
    header = "# a.py\n"                      # the language server's header: comment and base name
    assert int(row[0]) == 300 and _text(row[1:], len(header)) == header
    body = _text(row[1 + len(header):], len(CODE))
    assert body == CODE                      # the window, from a line start, nothing lost or invented
    assert not w[:len(header)].any() and w[len(header):len(header) + n].all()   # the header is not learnt
    # the prompt and the answer were tokenized apart, cut where the server cuts a prompt whose cursor
    # stands after a line's indentation: at the end of the line above (runtime/codeheader.heal_split)
    before, after = next((a, b) for a, b in zip(calls, calls[1:]) if a + b == CODE)
    if after.startswith("\n "):      # an indented line: healed
        assert not before.endswith("\n") and after.lstrip(" \n")[:1].strip()
    else:                              # a line at the margin: nothing to heal
        assert before.endswith("\n")
    again = Builder(_tok(bos=300), seq_len=400, fim_rate=1.0, seed=1).build([f])
    assert np.array_equal(again.tokens, s.tokens)


def test_a_cursor_after_indentation_is_cut_as_the_server_heals_it():
    import random

    calls: list[str] = []
    b = Builder(_tok(calls), seq_len=400, fim_rate=1.0)
    lines = CODE.splitlines(keepends=True)
    for seed in range(20):
        calls.clear()
        got = b.prefix(lines, "# a.py\n", random.Random(seed))
        before, after = calls[-2], calls[-1]
        assert got is not None and before + after == CODE
        c = before.count("\n") + (0 if before.endswith("\n") else 1)
        ind = lines[c][:len(lines[c]) - len(lines[c].lstrip(" "))]
        if ind:
            assert after.startswith("\n" + ind) and not before.endswith("\n")
        else:
            assert before.endswith("\n")


def test_prefix_windows_start_at_line_starts_under_the_header():
    b = Builder(_tok(), seq_len=64, fim_rate=1.0, seed=2)
    s = b.build([SourceFile("a.py", "python", CODE * 4)])
    assert set(s.kinds) <= {"prefix", "plain"} and s.kinds.count("prefix") >= len(s) // 2
    text = CODE * 4
    for row, w, kind in zip(s.tokens, s.weights, s.kinds):
        if kind == "prefix":
            n = int((w > 0).sum()) + len("# a.py\n")
            got = _text(row, n)
            assert got.startswith("# a.py\n")
            window = got[len("# a.py\n"):]
            at = text.find(window)
            assert at >= 0 and (at == 0 or text[at - 1] == "\n")   # a window from a line start
    assert s.tokens.shape[1] == 64


def test_fim_rate_zero_keeps_plain_windows():
    s = Builder(_tok(), seq_len=64, fim_rate=0.0).build([SourceFile("a.py", "python", CODE)])
    assert set(s.kinds) == {"plain"}


SRC = '''import x


@decorator
def documented(a, b=1):
    """Add them.

    Really."""
    c = a + b
    return c


class K:
    def method(self):
        """One line."""
        # a comment
        return self


def bare(a):
    return a


def only_docstring():
    """Nothing else."""
'''


def test_functions_pair_signature_and_docstring_with_the_body():
    got = list(functions(SRC))
    assert got == [
        ('@decorator\ndef documented(a, b=1):\n    """Add them.\n\n    Really."""\n    ', "c = a + b\n    return c\n"),
        ('    def method(self):\n        """One line."""\n        # a comment\n        ', "return self\n"),
    ]
    assert list(functions("def broken(:\n")) == []      # a file that does not parse gives no pairs


def test_docstring_pairs_learn_only_the_body():
    f = SourceFile("m.py", "python", SRC)
    s = Builder(_tok(), seq_len=256, fim_rate=0.0, pairs=True).build([f])
    pairs = [i for i, k in enumerate(s.kinds) if k == "pair"]
    assert len(pairs) == 2 and "plain" in s.kinds
    row, w = s.tokens[pairs[0]], s.weights[pairs[0]]
    n = int((row > 0).sum())
    prompt = "# m.py\n" + '@decorator\ndef documented(a, b=1):\n    """Add them.\n\n    Really."""\n    '
    assert _text(row, n) == prompt + "c = a + b\n    return c\n"
    # the prompt as the server heals it: cut at the end of the docstring's line, the line break and
    # the indentation learnt with the body
    healed = prompt[:-len("\n    ")]
    learnt = _text(row[len(healed):], n)
    assert not w[:len(healed) - 1].any() and w[len(healed) - 1:n - 1].all() and learnt.startswith("\n    c = a")
    fim = Builder(_tok(fim=True), seq_len=256, fim_rate=0.0, pairs=True).build([f])
    k = fim.kinds.index("pair")
    ids = [int(t) for t in fim.tokens[k]]
    mid = ids.index(MID)
    assert ids[0] == PRE and bytes(ids[1:ids.index(SUF)]).decode() == prompt
    assert bytes(ids[mid + 1:ids.index(END)]).decode() == "c = a + b\n    return c\n"
    assert not fim.weights[k, :mid].any() and fim.weights[k, mid:ids.index(END)].all()
    none = Builder(_tok(), seq_len=256, fim_rate=0.0).build([f])
    assert "pair" not in none.kinds
    other = Builder(_tok(), seq_len=256, fim_rate=0.0, pairs=True).build([SourceFile("m.js", "javascript", SRC)])
    assert "pair" not in other.kinds


def test_docstring_pairs_is_an_option_of_the_command():
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.config(p.parse_args(["repo", "--docstring-pairs"])).docstring_pairs is True
    assert cli.config(p.parse_args(["repo"])).docstring_pairs is False
    assert TuneConfig().docstring_pairs is False
