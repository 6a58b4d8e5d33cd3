"""The distribution holds every package of the source tree (a non-editable install must work too)."""
from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML without a package")
ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {"comfyui_a3b"}
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        skipped = rel.parts and rel.parts[0] in ("tests", "editors", "build", "dist")
        if skipped or any(p.startswith(".") for p in rel.parts):
            continue
        if rel.parts:
            found.add("comfyui_a3b." + ".".join(rel.parts))
    assert found == listed, (f"missing from pyproject: {sorted(found - listed)}; "
                             f"listed but absent: {sorted(listed - found)}")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _listed_distributions() -> set[str]:
    """The distributions `pip install -e ".[test,prune]"` asks for by name (core, test and prune)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in ("test", "prune"):
        reqs += project["optional-dependencies"][extra]
    return {_norm(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in reqs}


def _third_party_imports_of_tests() -> dict[str, list[str]]:
    local = {p.stem for p in (ROOT / "tests").glob("*.py")} | {"comfyui_a3b"}
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    found.setdefault(top, []).append(path.name)
    return found


def test_every_third_party_import_of_the_tests_is_installed_by_the_readme_command():
    """Each package the tests import is named in the core dependencies or the test/prune extras
    (not merely present on this machine, nor pulled in by another package that may drop it)."""
    listed = _listed_distributions()
    providers = importlib.metadata.packages_distributions()
    missing = []
    for module, files in sorted(_third_party_imports_of_tests().items()):
        dists = {_norm(d) for d in providers.get(module, [])}
        if not dists & listed:
            missing.append(f"{module} (imported by {', '.join(sorted(set(files))[:3])}; "
                           f"distribution {sorted(dists) or 'not installed here'})")
    assert not missing, "not installed by pip install -e \".[test,prune]\": " + "; ".join(missing)


def test_ci_runs_the_readme_commands_in_a_fresh_virtual_environment(tmp_path):
    """.ci/run makes a virtual environment in a temporary folder, runs the README's two commands with
    its python (where this machine's packages are not importable), and removes it afterwards."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    probe = ("python -c \"import sys, importlib.util; open('{0}.txt', 'w').write(sys.prefix + '|' + "
             "str(importlib.util.find_spec('numpy') is not None))\"")
    (tmp_path / "README.md").write_text(
        "# x\n\n<!-- ci:install -->\n```sh\n" + probe.format("install") + "\n```\n\n"
        "<!-- ci:test -->\n```sh\n" + probe.format("test") + "\n```\n")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["CI_PYTHON"] = sys.executable
    env["PYTHONPATH"] = str(ROOT)   # must not reach the environment
    r = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    installed = (tmp_path / "install.txt").read_text().split("|")
    tested = (tmp_path / "test.txt").read_text().split("|")
    assert installed == tested
    prefix, numpy_found = installed
    assert Path(prefix) != Path(sys.prefix) and Path(prefix).name == "venv"
    assert numpy_found == "False"   # installed here, absent from the fresh environment
    assert not Path(prefix).exists()   # the temporary folder is gone


def test_ci_fails_when_the_install_command_fails(tmp_path):
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text("<!-- ci:install -->\n```sh\nfalse\n```\n<!-- ci:test -->\n```sh\ntrue\n```\n")
    env = dict(os.environ, CI_PYTHON=sys.executable)
    r = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "install command failed" in r.stderr
