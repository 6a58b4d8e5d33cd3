"""The distribution holds every package of the source tree (a non-editable install must work too)."""
from __future__ import annotations

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
