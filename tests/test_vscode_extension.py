"""The VS Code extension compiles from the npm registry's packages (what a release build runs)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "editors" / "vscode"
NPM = shutil.which("npm")


@pytest.mark.skipif(NPM is None, reason="npm is not on PATH: building the VS Code extension needs Node.js 20+")
def test_extension_compiles(tmp_path):
    work = tmp_path / "vscode"
    shutil.copytree(SRC, work, ignore=shutil.ignore_patterns("node_modules", "out"))
    for cmd in (["ci", "--no-audit", "--no-fund"], ["run", "compile"]):
        proc = subprocess.run([NPM, *cmd], cwd=work, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = work / "out" / "extension.js"
    assert out.is_file() and "LanguageClient" in out.read_text()
