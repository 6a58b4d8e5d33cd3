"""The environment variables: declared once (runtime/environment.py), documented in
docs/configuration.md, and read through `env()` only.

Fast: reads the docs and the sources, no model.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from comfyui_a3b.runtime import environment, options
from comfyui_a3b.runtime.environment import VARIABLES, env, env_list, env_number, env_on, env_paths

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
#: names that look like variables but are not: a ComfyUI socket type (nodes/defs.py), the version of
#: the a3b.* metadata (prune/), a test's set of node names
CONSTANTS = {"A3B_MODEL", "A3B_VERSION", "A3B_NODES"}
NAME = re.compile(r"\bA3B_[A-Z0-9_]+\b")
PACKAGE_DIRS = ("runtime", "nodes", "lsp_server", "serve", "prune")
TEXT_SUFFIXES = {".py", ".lua", ".ts", ".js", ".json", ".toml", ".sh"}


def _documented() -> tuple[dict[str, str], set[str]]:
    """The table's variables (name -> its default cell) and the names the tests-only section lists."""
    text = DOC.read_text(encoding="utf-8")
    table, _, rest = text.partition("## Used by the tests and benchmarks only")
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\|\s*`(A3B_[A-Z0-9_]+)`\s*\|([^|]*)\|", line)
        if m:
            assert m[1] not in rows, f"{m[1]} is in the table twice"
            rows[m[1]] = m[2].strip()
    return rows, set(re.findall(r"`(A3B_[A-Z0-9_]+)`", rest))


def _sources(*dirs: str) -> list[Path]:
    out = []
    for d in dirs:
        base = ROOT / d
        paths = [base] if base.is_file() else base.rglob("*")
        out += [p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES and "node_modules" not in p.parts]
    return out


def test_the_docs_table_and_the_registry_name_the_same_variables():
    rows, _ = _documented()
    assert set(rows) - set(VARIABLES) == set(), "documented in docs/configuration.md but not declared"
    assert set(VARIABLES) - set(rows) == set(), "declared in runtime/environment.py but not documented"


def test_the_documented_defaults_are_the_declared_ones():
    rows, _ = _documented()
    for var in VARIABLES.values():
        if var.default:
            assert f"`{var.default}`" in rows[var.name], f"{var.name}: the docs say {rows[var.name]!r}"
        assert var.help and var.readers, var.name
        for reader in var.readers:
            assert (ROOT / reader).is_file(), f"{var.name}: no reader {reader}"


def _direct_reads(source: str) -> list[str]:
    """The os.environ / getenv reads of an A3B_* name written out in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args:
            target, key = ast.unparse(node.func), node.args[0]
            hit = target.endswith(("environ.get", "getenv"))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            target, key = ast.unparse(node.value), node.slice
            hit = target.endswith("environ")
        else:
            continue
        if hit and isinstance(key, ast.Constant) and isinstance(key.value, str) and NAME.match(key.value):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_direct_read_finder_finds_them():
    source = ('import os\nos.environ.get("A3B_CACHE", "1")\nos.getenv("A3B_VET")\nos.environ["A3B_LSP"]\n'
              'os.environ["A3B_SERVE"] = "1"\nos.environ.get("HOME")\n')
    assert [hit.split(":")[0] for hit in _direct_reads(source)] == ["2", "3", "4"]


def test_the_package_reads_no_undeclared_variable_and_only_through_env():
    """Every A3B_* name in the package's sources (Python and the editors' files) is declared or a
    known constant, and no module but environment.py reads os.environ/getenv for one."""
    direct = []
    for path in _sources(*PACKAGE_DIRS, "__init__.py", "cli.py", "cliwords.py", "editors", "web", "examples"):
        text = path.read_text(encoding="utf-8", errors="replace")
        unknown = set(NAME.findall(text)) - set(VARIABLES) - CONSTANTS
        assert not unknown, f"{path.relative_to(ROOT)} names undeclared variables {sorted(unknown)}"
        if path.suffix == ".py" and path.name != "environment.py":
            direct += [f"{path.relative_to(ROOT)}:{hit}" for hit in _direct_reads(text)]
    assert not direct, "read A3B_* variables through runtime.environment.env():\n" + "\n".join(direct)


def test_tests_and_benchmarks_use_declared_or_documented_names():
    _, test_only = _documented()
    for path in _sources("tests", "bench"):
        unknown = set(NAME.findall(path.read_text(encoding="utf-8", errors="replace"))) - set(VARIABLES) - CONSTANTS
        assert unknown <= test_only, (f"{path.relative_to(ROOT)}: {sorted(unknown - test_only)} are neither "
                                      "declared nor listed under 'Used by the tests and benchmarks only'")


def test_every_option_with_a_variable_names_a_declared_one():
    with_env = [o for o in vars(options).values() if isinstance(o, options.Option) and o.env]
    assert with_env
    for option in with_env:
        assert option.env in VARIABLES, option


def test_reading(monkeypatch, caplog):
    with pytest.raises(KeyError):
        env("A3B_" + "NOT_DECLARED")
    monkeypatch.setenv("A3B_VET", "")
    assert env("A3B_VET") == "on" and env_on("A3B_VET")   # empty: the default
    for word in ("off", " OFF ", "0", "no", "False"):
        monkeypatch.setenv("A3B_VET", word)
        assert not env_on("A3B_VET")
    assert env("A3B_SERVE", {"A3B_SERVE": "127.0.0.1:1"}) == "127.0.0.1:1"   # a mapping given instead
    monkeypatch.setenv("A3B_LSP_MAX_CLIENTS", "many")
    assert env_number("A3B_LSP_MAX_CLIENTS", int) == 32 and "not a number" in caplog.text
    monkeypatch.setenv("A3B_SERVE_ORIGINS", " http://a.test, ,http://b.test ")
    assert env_list("A3B_SERVE_ORIGINS") == ["http://a.test", "http://b.test"]
    monkeypatch.setenv("A3B_LORAS", f"/x{environment.os.pathsep}{environment.os.pathsep}/y")
    assert env_paths("A3B_LORAS") == ["/x", "/y"]


def test_values_are_read_when_used_not_at_import(monkeypatch):
    """A value set after the modules were imported still counts (the vetting decode limit and the
    sampling threads were read once, at import)."""
    from comfyui_a3b.runtime.models import vet
    from comfyui_a3b.runtime.llama import backend

    monkeypatch.setenv("A3B_VET_DECODE_MAX_GB", "1.5")
    assert vet.decode_max_bytes() == int(1.5 * (1 << 30))
    monkeypatch.setenv("A3B_SAMPLE_THREADS", "3")
    assert backend.sample_threads() == 3
    monkeypatch.delenv("A3B_SAMPLE_THREADS")
    assert 1 <= backend.sample_threads() <= 16


def test_the_libraries_are_looked_for_where_llama_cpp_python_loads_them(monkeypatch, tmp_path):
    """LLAMA_CPP_LIB_PATH makes llama-cpp-python load a llama.cpp built apart; libggml (the graph's
    entropy, the evaluation callbacks) must come from the same folder, not the package's own copy."""
    from comfyui_a3b.runtime.llama.binding import library_dir

    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    own = library_dir()
    assert own is not None and own.name == "lib"
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    assert library_dir() == tmp_path
