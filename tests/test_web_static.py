"""The web extension parses as an ES module (what ComfyUI's frontend imports), and the example
workflows open in the editor with nothing covered; no ComfyUI needed."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
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


def _build_examples():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "build_examples.py"
    spec = importlib.util.spec_from_file_location("build_examples", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_examples", mod)   # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules["build_examples"])
    return sys.modules["build_examples"]


@pytest.mark.parametrize("name", ["rag", "comic_script", "storyboard_json", "image_dialogue"])
def test_the_example_workflows_are_current_and_open_with_nothing_covered(name):
    """The files are what examples/build_examples.py writes from today's node declarations, every node
    is at least as large as the editor draws its widgets, and no node (title bar included) covers another."""
    be = _build_examples()
    ui, api = be.build(be.EXAMPLES[name]())
    folder = Path(__file__).resolve().parents[1] / "examples"
    assert json.loads((folder / f"{name}.json").read_text()) == ui
    assert json.loads((folder / "api" / f"{name}.api.json").read_text()) == api
    boxes = []
    for n in ui["nodes"]:
        (x, y), (w, h) = n["pos"], n["size"]
        need = be.min_size(n["type"], n.get("showAdvanced", False))
        assert w >= need[0] and h >= need[1], (n["id"], n["type"], (w, h), need)
        boxes.append((n["id"], x, y - be.TITLE_H, x + w, y + h))
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            apart = a[3] <= b[1] or b[3] <= a[1] or a[4] <= b[2] or b[4] <= a[2]
            assert apart, (name, a, b)
