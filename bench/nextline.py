"""Next-line exact match through the language server's completion path, for bench_tune.

A case is a line of a held-out file, written anew: the document is the file with that line
emptied down to its indentation (where an editor's auto-indent leaves the cursor after Enter), the
cursor at the end of the indentation, the code below still in place. The prompt is what the
language server sends for that cursor (lsp_server/prompt.py: the file header and a window of the
text before the cursor; a model without FIM tokens gets it as text to continue), sampled as the
server samples (lsp_server/completion.py SAMPLING, its token limit, a healed prompt's grammar),
and the answer goes through the server's post-processing (lsp_server/postprocess.finish). A hit
is the suggestion's first line, after the indentation already typed, equal to the line (trailing
spaces aside).

Cases run file by file, top to bottom, and the window's anchor carries over from one case to the
next as it does while a user moves down a file: the runtime's KV prefix reuse then covers the
shared start of consecutive prompts. Generation stops at the first newline (the server stops at a
blank-line run): the first line, the only one scored, comes out the same, in less time.
"""
from __future__ import annotations

import math
import random


def cases(files, n: int, seed: int, min_before: int = 200) -> list[tuple[int, int]]:
    """(file index, line index) of `n` seeded lines with at least 8 characters of code and
    `min_before` characters before them, in file order."""
    every = []
    for fi, f in enumerate(files):
        lines = f.text.splitlines(keepends=True)
        pos = 0
        for i, line in enumerate(lines):
            if pos >= min_before and len(line.strip()) >= 8:
                every.append((fi, i))
            pos += len(line)
    random.Random(seed).shuffle(every)
    return sorted(every[:n])


def document(text: str, i: int) -> tuple[str, int, str]:
    """(document text with line `i` emptied to its indentation, cursor offset, the line)."""
    lines = text.splitlines(keepends=True)
    line = lines[i].rstrip("\r\n")
    ind = line[:len(line) - len(line.lstrip(" \t"))]
    before = "".join(lines[:i]) + ind
    return before + "\n" + "".join(lines[i + 1:]), len(before), line


def run(rt, spec, files, picked, settings, answers: list | None = None) -> list[bool]:
    """Hit or miss per case, through the server's prompt and post-processing; the suggested lines go
    to `answers` when one is given."""
    from ..lsp_server.completion import SAMPLING
    from ..lsp_server.documents import Document
    from ..lsp_server.postprocess import finish, healed
    from ..lsp_server.prompt import PromptBuilder
    from ..runtime import PRIORITY_INTERACTIVE

    builder = PromptBuilder(rt.load(spec))
    use_fim = settings.fim != "off" and builder.fim is not None
    hits, anchors = [], {}
    for fi, i in picked:
        f = files[fi]
        text, off, line = document(f.text, i)
        uri = "file:///held-out/" + f.path
        cur = Document(uri, text, 0, f.language).cursor_at(off)
        p = builder.build(cur, anchor=anchors.get(fi), context_block="", budget=settings.context_tokens,
                          suffix_tokens=settings.suffix_tokens, use_fim=use_fim)
        anchors[fi] = p.anchor
        res = _first_line(rt, p.sent, p.heal, model=spec, max_tokens=settings.max_tokens,
                          sampling=SAMPLING, grammar=p.grammar, priority=PRIORITY_INTERACTIVE,
                          thinking="off")
        text = healed(res.text, p.heal)
        got = finish(text, cur, p.multiline).split("\n", 1)[0] if text else ""
        hits.append((cur.line_prefix + got).rstrip() == line.rstrip())
        if answers is not None:
            answers.append(cur.line_prefix + got)
    return hits


def _first_line(rt, sent, heal: str, **kw):
    """Generate for `sent`; a healed prompt (codeheader.heal_split) starts its answer with the line break,
    so its generation is cancelled once the line after it is complete (the partial result kept)."""
    from ..runtime.errors import Cancelled

    if not heal:
        return rt.submit(sent, stop=["\n"], **kw).result()
    box: list = []
    seen = [""]

    def on_token(ev) -> None:
        seen[0] += ev.text
        if box and "\n" in seen[0][len(heal):]:
            box[0].cancel("first line")

    box.append(rt.submit(sent, on_token=on_token, **kw))
    try:
        return box[0].result()
    except Cancelled as e:
        return e.partial


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a rate k/n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (mid - half) / (1 + z * z / n)), min(1.0, (mid + half) / (1 + z * z / n))


def sign_test(only_a: int, only_b: int) -> float:
    """Two-sided exact sign test over the cases where exactly one side is right."""
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, j) for j in range(k + 1)) / 2 ** n)


def compare(base: list[bool], tuned: list[bool]) -> dict:
    n = len(base)
    kb, kt = sum(base), sum(tuned)
    only_b = sum(b and not t for b, t in zip(base, tuned))
    only_t = sum(t and not b for b, t in zip(base, tuned))
    return {"cases": n, "base_hits": kb, "tuned_hits": kt, "base_ci95": wilson(kb, n), "tuned_ci95": wilson(kt, n),
            "only_base": only_b, "only_tuned": only_t, "sign_test_p": sign_test(only_b, only_t)}
