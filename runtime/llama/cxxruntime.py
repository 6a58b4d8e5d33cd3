"""Two copies of the C++ runtime in one process: found before llama.cpp crashes on it.

Some CUDA builds of llama-cpp-python link parts of the C++ runtime (libstdc++'s locale and stream
machinery) into `libggml-cuda.so` and export them. That is harmless when llama.cpp's libraries load
first: the system's libstdc++, loaded after them, binds to the same copy. It is fatal when the
system's libstdc++ was loaded first (torch and numpy load it; in ComfyUI they always come first):
each library then uses its own copy of the locale tables, and llama.cpp's first `std::stringstream`
(printing the model's hyper-parameters while loading) dereferences a facet the other copy owns:
a segmentation fault, at any `n_gpu_layers`.

So:
- `preload()` imports llama_cpp before anything else where this process has not loaded libstdc++
  yet (the CLI, the language server, tests): the safe order.
- `clash()` says, after llama_cpp is imported, whether this process is in the fatal state: the
  system libstdc++ came first and a llama.cpp library carries its own copy (its address of a
  libstdc++ symbol differs from libstdc++'s). The binding then refuses with a message instead of
  letting the first load crash the host.
"""
from __future__ import annotations

import ctypes
import os
import sys

from ..environment import env

#: a symbol every libstdc++ defines and no program code does: where a library defines it too, that
#: library carries a copy of the C++ runtime
PROBE = "_ZNSt6locale5facetD1Ev"   # std::locale::facet::~facet()

_stdcxx_first: bool | None = None   # None: unknown (llama_cpp was imported before we could look)


def mapped_libraries() -> list[str]:
    """Paths of the shared libraries this process has mapped (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.rsplit(" ", 1)[-1].strip() for line in f if ".so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def _has(prefix: str, libs: list[str]) -> bool:
    return any(os.path.basename(p).startswith(prefix) for p in libs)


def note_order() -> None:
    """Record, before llama_cpp is imported, whether the system's libstdc++ is loaded already."""
    global _stdcxx_first
    if _stdcxx_first is None and "llama_cpp" not in sys.modules:
        _stdcxx_first = _has("libstdc++.so", mapped_libraries())


def preload() -> None:
    """Import llama_cpp now where libstdc++ is not loaded yet (then its libraries come first)."""
    note_order()
    if _stdcxx_first is False and env("A3B_PRELOAD_LLAMA") != "off":
        try:
            import llama_cpp  # noqa: F401
        except Exception:  # noqa: BLE001 - reported with its reason when the binding is first used
            pass


def _address(path: str) -> int | None:
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)   # the copy already loaded
        return ctypes.cast(getattr(lib, PROBE), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def carriers(libs: list[str] | None = None) -> list[str]:
    """The loaded llama.cpp libraries (libllama, libggml*) that carry their own C++ runtime, whichever
    was loaded first: where the system's libstdc++ is loaded, those whose address of PROBE is not its
    own; where it is not loaded yet, those that define PROBE at all (a copy of their own)."""
    libs = mapped_libraries() if libs is None else libs
    stdcxx = next((p for p in libs if os.path.basename(p).startswith("libstdc++.so")), None)
    system = _address(stdcxx) if stdcxx else None
    if stdcxx and system is None:
        return []   # the system's copy does not answer: nothing to compare with
    out = []
    for p in libs:
        name = os.path.basename(p)
        if name.startswith(("libggml", "libllama")):
            own = _address(p)
            if own is not None and own != system:
                out.append(name)
    return out


def clash() -> str | None:
    """A message when this process is in the state that crashes llama.cpp's first load, else None."""
    if not _stdcxx_first:
        return None
    found = carriers()
    if not found:
        return None
    return (f"this llama-cpp-python build cannot run in this process: {', '.join(found)} carries its own copy "
            "of the C++ runtime, and the process loaded the system's libstdc++ before it (torch and numpy do), "
            "a mix that crashes llama.cpp's first model load. Rebuild llama-cpp-python as the README's GPU "
            "section shows (the C++ runtime linked as a shared library), or, outside ComfyUI, import llama_cpp "
            "before torch and numpy.")
