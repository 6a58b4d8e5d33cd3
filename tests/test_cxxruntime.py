"""The check for a llama.cpp library carrying its own C++ runtime (runtime/llama/cxxruntime.py).

A CUDA build seen in practice exported libstdc++'s locale machinery from libggml-cuda.so and crashed
at the first model load whenever torch or numpy had loaded the system's libstdc++ first. These
tests build two small shared libraries named like ggml's, one with the C++ runtime linked in
statically and one without, load them after numpy in a fresh interpreter, and check that only the
first is found and that the runtime would refuse (with a message) rather than crash.
"""
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or not sys.platform.startswith("linux"),
                                reason="needs g++ on Linux to build the test libraries")

SOURCE = ('#include <sstream>\n'
          'extern "C" int width(int x) { std::stringstream s; s << x; return (int)s.str().size(); }\n')


def _build(tmp_path, name, static):
    src = tmp_path / "w.cpp"
    src.write_text(SOURCE)
    out = tmp_path / name
    flags = ["-static-libstdc++"] if static else []
    subprocess.run(["g++", "-shared", "-fPIC", *flags, "-o", str(out), str(src)], check=True, timeout=120)
    return out


def test_a_library_that_carries_its_own_cxx_runtime_is_found_and_refused(tmp_path):
    carrier = _build(tmp_path, "libggml-carrier.so", static=True)
    plain = _build(tmp_path, "libggml-plain.so", static=False)
    code = textwrap.dedent(f"""
        import ctypes, numpy
        from comfyui_a3b.runtime.llama import cxxruntime as c
        for p in ({str(plain)!r}, {str(carrier)!r}):
            ctypes.CDLL(p)
        print(c.carriers())
        c._stdcxx_first = True      # as in ComfyUI: torch loaded libstdc++ before llama.cpp
        print(c.clash())
        c._stdcxx_first = False     # llama.cpp's libraries first: the safe order
        print(c.clash())
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    found, refused, safe = p.stdout.splitlines()
    assert found == "['libggml-carrier.so']"
    assert "libggml-carrier.so carries its own copy of the C++ runtime" in refused and "README" in refused
    assert safe == "None"


def test_our_own_processes_load_llama_cpp_before_the_cxx_runtime():
    """Importing the package where nothing loaded libstdc++ yet imports llama_cpp first."""
    code = ("import comfyui_a3b, sys; from comfyui_a3b.runtime.llama import cxxruntime as c; "
            "print(c._stdcxx_first, 'llama_cpp' in sys.modules)")
    p = subprocess.run([sys.executable, "-S", "-c", "import site; site.main(); " + code], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "True"]


def test_override_patterns_are_refused_beside_such_a_build_and_the_planners_need_no_re2(tmp_path):
    """RE2's extension crashed a process whose CUDA llama.cpp build carried its own C++ runtime; there a
    user's override_tensor pattern is refused with what to do, and the planner's own layer patterns
    (matched with Python's re) still place the experts."""
    carrier = _build(tmp_path, "libggml-carrier.so", static=True)
    code = textwrap.dedent(f"""
        import ctypes, sys
        sys.modules["re2"] = None          # any import of RE2 fails loudly here
        from comfyui_a3b.runtime.errors import InvalidRequest
        from comfyui_a3b.runtime.llama import tensorpatterns as tp
        from comfyui_a3b.runtime.llama.placement import layer_pattern
        names = ["blk.0.ffn_up_exps.weight", "blk.1.ffn_up_exps.weight", "blk.0.attn_q.weight"]
        print(tp.for_llama([(layer_pattern(1, 2, True), "CPU")], names, 100))
        del sys.modules["re2"]
        ctypes.CDLL({str(carrier)!r})
        try:
            tp.compiled("ffn_.*_exps")
        except InvalidRequest as e:
            print(e)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    placed, refused = p.stdout.splitlines()
    assert placed == "[('^(?:blk\\\\.0\\\\.ffn_up_exps\\\\.weight)$', 'CPU')]"
    assert "libggml-carrier.so carries its own copy of the C++ runtime" in refused and "README" in refused
