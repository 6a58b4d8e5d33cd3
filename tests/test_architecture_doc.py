"""docs/architecture.md's rules hold for the code: the package import table, the third-party library
table, the order of the packages outside the runtime, and the sizes of that page and the README.

The statements are read from the page itself, between `<!-- checked:NAME -->` markers, and compared
with the real import graph (tests/test_imports.py builds it from every module's source). A package
is named as the page names it: a folder with a slash (`prune/`, `runtime/llama/`; `runtime/` alone
is the modules at runtime/'s top level), a module at the root by its file (`__init__.py`), and the
CLI's modules at the root together as `cli*.py`.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_imports import build_graph, initialised_by

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"


def section(text: str, name: str) -> str:
    found = re.search(rf"<!-- checked:{name} -->(.*?)<!-- /checked:{name} -->", text, re.S)
    assert found, f"{DOC.name} lacks its checked statement '{name}'"
    return found.group(1)


def table(block: str) -> dict[str, str]:
    """A two-column markdown table as {first cell's name: second cell}, header and rule left out."""
    rows = {}
    for line in block.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 2, f"not a two-column row: {line!r}"
        key = re.fullmatch(r"`([^`]+)`", cells[0])
        assert key, f"the first cell is not one name in backticks: {line!r}"
        rows[key.group(1)] = cells[1]
    return rows


def names(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def unit(module: str, packages: set[str]) -> str:
    """The package, as the page names it, that a dotted module name (relative to the pack) belongs to."""
    if module == "":
        return "__init__.py"
    parts = module.split(".")
    if len(parts) == 1:
        if module in packages:
            return module + "/"
        return "cli*.py" if module.startswith("cli") else module + ".py"
    if parts[0] == "runtime" and "runtime." + parts[1] in packages:
        return f"runtime/{parts[1]}/"
    return parts[0] + "/"


@pytest.fixture(scope="module")
def real():
    """(package -> packages it imports, library -> packages importing it), from the code."""
    graph = build_graph()
    packages = {n for n, m in graph.items() if m.is_package}
    imports: dict[str, set[str]] = {}
    libraries: dict[str, set[str]] = {}
    for m in graph.values():
        here = unit(m.name, packages)
        out = imports.setdefault(here, set())
        for target, _, _ in m.imports:
            out.update(unit(t, packages) for t in initialised_by(m.name, target) if t in graph)
        for top, _ in m.external:
            libraries.setdefault(top, set()).add(here)
    for here, out in imports.items():
        out.discard(here)
    return imports, libraries


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def test_units_are_named_as_the_page_names_them():
    packages = {"runtime", "runtime.llama", "prune", "prune.dense", "bench"}
    assert unit("", packages) == "__init__.py"
    assert unit("cliwords", packages) == "cli*.py"
    assert unit("runtime", packages) == "runtime/"
    assert unit("runtime.core", packages) == "runtime/"
    assert unit("runtime.llama.binding", packages) == "runtime/llama/"
    assert unit("prune.dense.heads", packages) == "prune/"
    assert unit("bench", packages) == "bench/"


def test_every_package_has_a_row_in_the_import_table(doc, real):
    rows = table(section(doc, "imports"))
    missing = sorted(set(real[0]) - set(rows))
    stale = sorted(set(rows) - set(real[0]))
    assert not missing, f"packages without a row in {DOC.name}'s import table: {missing}"
    assert not stale, f"rows of {DOC.name}'s import table that name no package: {stale}"


def import_table_errors(text: str, imports: dict[str, set[str]]) -> list[str]:
    wrong = []
    for package, cell in table(section(text, "imports")).items():
        if cell.strip() == "any":
            continue
        said, done = names(cell), imports.get(package, set())
        if done - said:
            wrong.append(f"{package} also imports {sorted(done - said)}")
        if said - done:
            wrong.append(f"{package} no longer imports {sorted(said - done)}")
    return wrong


def library_table_errors(text: str, libraries: dict[str, set[str]]) -> list[str]:
    wrong = []
    for library, cell in table(section(text, "libraries")).items():
        said, done = names(cell), libraries.get(library, set())
        if said != done:
            wrong.append(f"{library}: the page says {sorted(said)}, the code has {sorted(done)}")
    return wrong


def test_the_import_table_is_the_code(doc, real):
    wrong = import_table_errors(doc, real[0])
    assert not wrong, f"{DOC.name}'s import table is false (change the code or the table):\n  " + "\n  ".join(wrong)


def test_the_library_table_is_the_code(doc, real):
    wrong = library_table_errors(doc, real[1])
    assert not wrong, f"{DOC.name}'s library table is false:\n  " + "\n  ".join(wrong)


def test_the_checks_catch_false_tables():
    page = ("<!-- checked:imports -->\n| package | imports |\n|---|---|\n| `serve/` | `runtime/` |\n"
            "| `bench/` | any |\n<!-- /checked:imports -->\n<!-- checked:libraries -->\n| library | imported by |\n"
            "|---|---|\n| `llama_cpp` | `runtime/llama/` |\n<!-- /checked:libraries -->")
    code = {"serve/": {"runtime/", "runtime/models/"}, "bench/": {"nodes/"}}
    assert import_table_errors(page, code) == ["serve/ also imports ['runtime/models/']"]
    assert import_table_errors(page, {"serve/": set()}) == ["serve/ no longer imports ['runtime/']"]
    assert library_table_errors(page, {"llama_cpp": {"runtime/llama/", "nodes/"}}) == [
        "llama_cpp: the page says ['runtime/llama/'], the code has ['nodes/', 'runtime/llama/']"]
    assert library_table_errors(page, {"llama_cpp": {"runtime/llama/"}}) == []


def test_the_packages_outside_the_runtime_have_no_cycle(doc, real):
    assert "without a" in section(doc, "acyclic")
    graph = {p: {t for t in out if not t.startswith("runtime/")}
             for p, out in real[0].items() if not p.startswith("runtime/")}
    done: set[str] = set()

    def visit(p: str, path: list[str]) -> None:
        if p in path:
            raise AssertionError("packages importing each other: " + " -> ".join([*path[path.index(p):], p]))
        if p in done:
            return
        for q in sorted(graph.get(p, ())):
            visit(q, [*path, p])
        done.add(p)

    for p in sorted(graph):
        visit(p, [])


def test_the_pages_keep_their_sizes(doc):
    limits = dict(re.findall(r"(\S+) (?:is )?at most (\d+)\s+bytes", section(doc, "sizes")))
    assert limits == {"page": "15000", "README.md": "18000"}, limits
    assert len(doc.encode()) <= int(limits["page"]), f"{DOC.name} is {len(doc.encode())} bytes"
    size = len(README.read_bytes())
    assert size <= int(limits["README.md"]), f"README.md is {size} bytes"


def test_the_readme_keeps_the_commands_ci_runs():
    # .ci/run takes the first code line after each marker; a rewrite of the README must keep both
    text = README.read_text(encoding="utf-8")
    found = {}
    for name in ("install", "test"):
        after = text.split(f"\n<!-- ci:{name} -->\n", 1)
        assert len(after) == 2, f"README.md lacks <!-- ci:{name} -->"
        block = re.match(r"```\w*\n(.*?)\n```", after[1], re.S)
        assert block, f"no code block right after <!-- ci:{name} -->"
        found[name] = next(line for line in block.group(1).splitlines() if line.strip())
    assert found["install"].startswith('pip install -e ".[test,prune]" && a3b generate ')
    test = found["test"]
    assert test.startswith("ruff check . && ") and '-m "not slow"' in test and "-m slow" in test
