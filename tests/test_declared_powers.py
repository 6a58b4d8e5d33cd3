"""The runtime asks its parts what they can do through what they declare, never by probing.

A model, a backend, a sampler or a weight file says what it supports through the attributes and
methods of its base class in runtime/engine.py and runtime/local/seam.py (`Backend.mtp`, `Model.draft_source`,
`Weights.n_layer_nextn`, ...). A `getattr(x, "name", default)` or `hasattr(x, "name")` in the
runtime's policy modules would let a part that forgot a power pass silently as one without it
(the fake engine and llama.cpp drifting apart unseen). Probing a foreign library stays allowed
where it lives: the C libraries under runtime/llama/ and libc in runtime/models/memory.py.
"""
from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parent.parent / "runtime"
#: the runtime's own folders (runtime/llama/ probes llama.cpp's libraries, which it wraps)
FOLDERS = (".", "local", "models", "remote")
#: modules that probe a C library's symbols, which no base class of ours can declare
FOREIGN = {"models/memory.py"}


def _probes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            found.append(f"{path.name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_the_runtime_never_probes_its_own_parts_by_name():
    files = sorted(f for d in FOLDERS for f in (RUNTIME / d).glob("*.py"))
    assert {"core.py", "worker.py", "store.py", "model.py"} <= {f.name for f in files}
    found = [p for f in files if f.relative_to(RUNTIME).as_posix() not in FOREIGN for p in _probes(f)]
    assert found == []


def test_the_check_sees_a_probe(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f(m):\n    return getattr(m, 'mtp', None) or hasattr(m, 'vision')\n")
    assert len(_probes(f)) == 2


def test_the_store_wires_no_engine_power():
    """The model store loads, shares and unloads; what a model drafts with is its engine's business
    (attached as the engine opens it, a draft model got through the store as an entry of its own), so
    the store names no drafting and the Model interface declares no step for it."""
    from comfyui_a3b.runtime.engine import Model

    tree = ast.parse((RUNTIME / "models" / "store.py").read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not [n for n in names if "draft" in n.lower() or "specul" in n.lower()]
    assert not [n for n in vars(Model) if "draft" in n and callable(vars(Model)[n])]
