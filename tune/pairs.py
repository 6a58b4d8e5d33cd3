"""Docstring → body pairs from Python files: a function's signature and docstring as the prompt,
its body as the target.

Python's `ast` finds the functions (methods and nested functions included) whose body starts with a
docstring and has at least one statement after it. The prompt is the function's text from its
first decorator (or `def`) through the line before its first statement after the docstring, plus
that statement's indentation: where an editor's cursor stands once the docstring is written. The
target is the rest of the function. Only the target is learnt.

A file that does not parse (Python 2, a template) gives no pairs; the work is one parse per file.
"""
from __future__ import annotations

import ast
import warnings
from collections.abc import Iterator

from ..runtime.codeheader import heal_split
from .collect import SourceFile


def functions(text: str) -> Iterator[tuple[str, str]]:
    """(signature and docstring up to the cursor, body) of each documented function in `text`."""
    try:
        with warnings.catch_warnings():   # invalid escape sequences in old code are not our business
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return
    lines = text.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        if ast.get_docstring(node, clean=False) is None:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        first = node.body[1].lineno - 1
        end = node.end_lineno or len(lines)
        if first >= len(lines) or first <= start:
            continue
        line = lines[first]
        ind = line[:len(line) - len(line.lstrip(" \t"))]
        yield "".join(lines[start:first]) + ind, line[len(ind):] + "".join(lines[first + 1:end])


def docstring_pairs(f: SourceFile, builder, header: str) -> list[tuple[list[int], list[float]]]:
    """The pairs of a Python file as samples in the builder's layout (none for other languages)."""
    if f.language != "python":
        return []
    out = []
    for before, body in functions(f.text):
        if builder.layout == "fim":
            got = builder.fim_ids(header + before, body, "", learn_prefix=False)
        else:
            ind = before[before.rfind("\n") + 1:]
            cut, heal = heal_split(before, ind)   # the prompt as the server cuts it at that cursor
            got = builder.prefix_ids(header, cut, heal + body, learn_before=False)
        if got is not None:
            out.append(got)
    return out
