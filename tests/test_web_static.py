"""The web extension parses as an ES module (what ComfyUI's frontend imports); no ComfyUI needed."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

WEB = Path(__file__).resolve().parent.parent / "web"


@pytest.mark.parametrize("path", sorted(WEB.glob("*.js")), ids=lambda p: p.name)
def test_extension_is_a_valid_module(path, tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    # .mjs: parsed as an ES module whatever node's default is
    copy = tmp_path / (path.stem + ".mjs")
    copy.write_text(path.read_text())
    p = subprocess.run([node, "--check", str(copy)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_a_syntax_error_is_caught(tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    bad = tmp_path / "bad.mjs"
    bad.write_text('import { app } from "../../scripts/app.js";\nconst = 3;\n')
    assert subprocess.run([node, "--check", str(bad)], capture_output=True).returncode != 0
