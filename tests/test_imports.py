"""The package's import graph, read from the sources: no cycles, llama.cpp only under runtime/llama/,
no module over 500 lines.

The graph is built with `ast` from every module of the package (the repository root minus tests and
the non-Python folders): relative imports are resolved, and imports inside functions count as
edges like the others, since a cycle hidden in a function is still a cycle (it only fails later,
and elsewhere). `from . import x` is an edge to the module `x` where `x` is one, else to the
package. A module outside a package that imports one of its submodules also depends on that
package's `__init__`, which Python runs first (runtime/models/vet.py importing runtime/llama/binding.py
runs runtime/llama/__init__.py); a module inside the package does not, its package being under way
already (else each package's `__init__` would close a cycle with each of its modules). Imports
under `if TYPE_CHECKING:` count too: they never run, but two modules that name each other's types
are one module split in two, and the cycle fails the day someone needs the name at run time.
Docstrings do not count as naming llama.cpp's libraries.

An offender that another change in progress removes may be named in the allow-lists below, with
what removes it; the lists are meant to stay empty, never extended to make a new offence pass.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "comfyui_a3b"
#: folders under the root that are no part of the importable package
NOT_PACKAGE = {"tests", "editors", "web", "examples", "docs", "build", "dist"}
MAX_LINES = 500

#: edges (importer, imported) that close a cycle and are being removed by another change
ALLOWED_CYCLE_EDGES: dict[tuple[str, str], str] = {}
#: modules over MAX_LINES that are being split by another change
ALLOWED_LONG: dict[str, str] = {}
#: modules outside runtime/llama that reach llama.cpp, and what removes that
ALLOWED_LLAMA: dict[str, str] = {}

#: where llama.cpp may be called: the in-process engine
LLAMA_HOME = "runtime.llama"
#: the benchmarks measure the package against llama-cpp-python's own API and run as scripts: the
#: llama.cpp and relative-import rules are for the package's code, not for that harness
HARNESS = "bench"
#: names of runtime/llama that hand out llama.cpp itself (the ctypes module, a library handle)
RAW_HANDLES = {("runtime.llama", "llama"), ("runtime.llama.binding", "llama"), ("runtime.llama.ggml", "lib")}
#: strings that, in a module using ctypes, mean it loads one of llama.cpp's libraries itself
LIBRARY_MARKS = ("libllama", "libggml", "ggml-base", "llama_cpp")


@dataclass
class Module:
    name: str                 # dotted, relative to the package ("" for the root __init__)
    path: Path
    is_package: bool
    lines: int = 0
    imports: list[tuple[str, int, bool]] = field(default_factory=list)   # (target, line, inside a function)
    external: list[tuple[str, int]] = field(default_factory=list)        # (top-level name, line)
    handles: list[tuple[str, int]] = field(default_factory=list)         # raw llama.cpp handles imported
    uses_ctypes: bool = False
    library_strings: list[int] = field(default_factory=list)             # lines naming llama.cpp libraries
    absolute: list[int] = field(default_factory=list)                    # lines importing the package by name


def _module_files() -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_PACKAGE or any(p.startswith(".") for p in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        # only folders that are packages (every folder on the way has an __init__.py)
        if not all((ROOT.joinpath(*rel.parts[:i]) / "__init__.py").is_file() for i in range(1, len(rel.parts))):
            continue
        name = ".".join(parts)
        mods[name] = Module(name, path, is_pkg)
    return mods


def _walk(tree: ast.AST):
    """(node, inside a function) for every node, `if TYPE_CHECKING:` bodies included."""
    stack = [(tree, False)]
    while stack:
        node, in_fn = stack.pop()
        yield node, in_fn
        fn = in_fn or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((c, fn) for c in ast.iter_child_nodes(node))


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def build_graph() -> dict[str, Module]:
    mods = _module_files()
    for m in mods.values():
        src = m.path.read_text(encoding="utf-8")
        m.lines = src.count("\n") + (0 if src.endswith("\n") else 1)
        tree = ast.parse(src, str(m.path))
        here = m.name if m.is_package else m.name.rpartition(".")[0]
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node, in_fn in _walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings and any(
                    mark in node.value for mark in LIBRARY_MARKS):
                m.library_strings.append(node.lineno)
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    if top == "ctypes":
                        m.uses_ctypes = True
                    if top == PACKAGE:
                        m.absolute.append(node.lineno)
                        m.imports.append((_deepest(mods, a.name[len(PACKAGE) + 1:]), node.lineno, in_fn))
                    else:
                        m.external.append((top, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0:
                    top = (node.module or "").split(".")[0]
                    if top == "ctypes":
                        m.uses_ctypes = True
                    if top != PACKAGE:
                        m.external.append((top, node.lineno))
                        continue
                    m.absolute.append(node.lineno)
                    base = (node.module or "")[len(PACKAGE) + 1:]
                else:
                    up = here.split(".") if here else []
                    if node.level - 1 > len(up):
                        raise AssertionError(f"{m.path}:{node.lineno}: relative import beyond the package")
                    base = _join(".".join(up[:len(up) - (node.level - 1)]), node.module or "")
                for a in node.names:
                    target = _join(base, a.name)
                    if target in mods:
                        m.imports.append((target, node.lineno, in_fn))
                    else:
                        m.imports.append((_deepest(mods, base), node.lineno, in_fn))
                        if (base, a.name) in RAW_HANDLES:
                            m.handles.append((f"{base}.{a.name}", node.lineno))
    return mods


def _deepest(mods: dict[str, Module], dotted: str) -> str:
    """The module a dotted name refers to: itself, or the deepest package above it that exists."""
    parts = dotted.split(".") if dotted else []
    while parts and ".".join(parts) not in mods:
        parts.pop()
    return ".".join(parts)


def initialised_by(importer: str, target: str) -> list[str]:
    """What importing `target` from `importer` runs: the target, and every package above it that
    `importer` lies outside of (its `__init__` runs first; the root package is always under way)."""
    parts = target.split(".") if target else []
    above = [".".join(parts[:i]) for i in range(1, len(parts))]
    return [p for p in above if importer != p and not importer.startswith(p + ".")] + [target]


def edges(mods: dict[str, Module]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {n: set() for n in mods}
    for m in mods.values():
        for target, _, _ in m.imports:
            for t in initialised_by(m.name, target):
                if t in mods and t != m.name and (m.name, t) not in ALLOWED_CYCLE_EDGES:
                    out[m.name].add(t)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path that returns to its start) per strongly connected component of the graph."""
    return [_cycle_in(graph, comp) for comp in components(graph)]


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (each holds at least one cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    comps: list[set[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan's algorithm, iterative over each node's successors
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return comps


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first back to it)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def _where(mods: dict[str, Module], a: str, b: str) -> str:
    m = mods[a]
    lines = [f"{ln}{' (in a function)' if fn else ''}{'' if t == b else f' (of {t})'}"
             for t, ln, fn in m.imports if b in initialised_by(a, t)]
    return f"{m.path.relative_to(ROOT)}:{', '.join(lines)}"


@pytest.fixture(scope="module")
def graph() -> dict[str, Module]:
    return build_graph()


def test_the_graph_sees_the_package(graph):
    # the builder itself: it finds the packages and resolves relative imports, also inside functions
    assert {"runtime", "runtime.llama", "prune", "cli", ""} <= set(graph)
    assert "runtime.errors" in {t for t, _, _ in graph["runtime.llama.binding"].imports}
    inside = sum(1 for m in graph.values() for _, _, fn in m.imports if fn)
    assert inside > 0
    # a type-only import (local/seam.py names the step type its Backend decodes) is an edge too
    assert "runtime.local.scheduler" in {t for t, _, _ in graph["runtime.local.seam"].imports}


def test_cycle_finder_finds_a_hidden_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    found = cycles(g)
    assert found == [["a", "b", "c", "a"]]


def test_importing_a_submodule_runs_the_packages_above_it_first():
    assert initialised_by("runtime.models.vet", "runtime.llama.binding") == ["runtime.llama", "runtime.llama.binding"]
    assert initialised_by("prune.pipeline", "runtime.llama.graph") == ["runtime", "runtime.llama",
                                                                       "runtime.llama.graph"]
    assert initialised_by("runtime.llama.weights", "runtime.llama.binding") == ["runtime.llama.binding"]
    assert initialised_by("cli", "runtime") == ["runtime"]


def test_no_import_cycles(graph):
    g = edges(graph)
    comps = components(g)
    text = []
    for comp in comps:
        cyc = _cycle_in(g, comp)
        hops = [f"    {a or PACKAGE} -> {b or PACKAGE}  ({_where(graph, a, b)})" for a, b in zip(cyc, cyc[1:])]
        text.append(f"  {len(comp)} modules import each other: {', '.join(sorted(comp))}\n  for one: "
                    + " -> ".join(n or PACKAGE for n in cyc) + "\n" + "\n".join(hops))
    assert not comps, "import cycles:\n" + "\n".join(text)


def test_allow_lists_name_real_offences(graph):
    # an entry whose offence is gone must leave its list, so the lists can only shrink
    g = {n: {t for t, _, _ in m.imports} for n, m in graph.items()}
    stale = [e for e in ALLOWED_CYCLE_EDGES if e[1] not in g.get(e[0], set())]
    stale += [n for n in ALLOWED_LONG if n not in graph or graph[n].lines <= MAX_LINES]
    stale += [n for n in ALLOWED_LLAMA if n not in graph or not _llama_offences(graph[n])]
    assert not stale, f"allow-list entries with nothing left to allow: {stale}"


def test_modules_are_short(graph):
    long = {n: m.lines for n, m in graph.items() if m.lines > MAX_LINES and n not in ALLOWED_LONG}
    assert not long, f"modules over {MAX_LINES} lines: " + ", ".join(
        f"{graph[n].path.relative_to(ROOT)} ({k})" for n, k in sorted(long.items()))


def _harness(name: str) -> bool:
    return name == HARNESS or name.startswith(HARNESS + ".")


def _llama_offences(m: Module) -> list[str]:
    out = [f"imports {top} (line {ln})" for top, ln in m.external if top == "llama_cpp"]
    out += [f"imports {h}, llama.cpp's own handle (line {ln})" for h, ln in m.handles]
    if m.uses_ctypes and m.library_strings:
        out.append(f"loads llama.cpp's libraries by ctypes (line {m.library_strings[0]})")
    elif m.library_strings and any(top == "importlib" for top, _ in m.external):
        out.append(f"finds llama.cpp's package or libraries itself (line {m.library_strings[0]})")
    return out


def test_llama_cpp_only_under_runtime_llama(graph):
    bad = {}
    for n, m in graph.items():
        if n == LLAMA_HOME or n.startswith(LLAMA_HOME + ".") or n in ALLOWED_LLAMA or _harness(n):
            continue
        found = _llama_offences(m)
        if found:
            bad[str(m.path.relative_to(ROOT))] = found
    assert not bad, "llama.cpp reached outside runtime/llama/:\n" + "\n".join(
        f"  {p}: {'; '.join(v)}" for p, v in sorted(bad.items()))


def test_imports_inside_the_package_are_relative(graph):
    # ComfyUI imports the pack under another name: an absolute import would load a second copy
    absolute = [f"{m.path.relative_to(ROOT)}:{ln}" for m in graph.values() for ln in m.absolute
                if not _harness(m.name)]
    assert not absolute, f"absolute imports of the package itself: {absolute}"


def test_the_runtime_top_level_holds_the_api_only(graph):
    # the runtime's own modules (its API, the request and result types, text rules) sit at its top;
    # model management, each engine and llama.cpp have folders of their own (docs/architecture.md)
    top = [n for n in graph if n.startswith("runtime.") and n.count(".") == 1 and not graph[n].is_package]
    assert len(top) <= 19, f"{len(top)} modules at runtime/'s top level: {sorted(top)}"
    assert {"runtime.local", "runtime.models", "runtime.llama", "runtime.remote"} <= set(graph)
