"""The compute devices llama.cpp sees (CPU, CUDA GPUs, ...) and their free memory.

llama-cpp-python does not bind ggml's device API, so the few functions needed are bound here from
the ggml library it ships (`libggml` beside `libllama`): `ggml_backend_dev_count/get/name/
description/type/memory`. llama.cpp registers its backends when `llama_backend_init` runs (see
binding.llama()), so the list is only read after that. A CPU-only build lists the CPU alone.
"""
from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass

from .cxxruntime import mapped_libraries
from .binding import llama

#: enum ggml_backend_dev_type
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}

_lib = None


@dataclass(frozen=True)
class Device:
    index: int
    name: str            # e.g. "CUDA0"
    description: str     # e.g. "NVIDIA H200"
    type: str            # cpu | gpu | igpu | accel
    free_bytes: int
    total_bytes: int

    @property
    def is_gpu(self) -> bool:
        return self.type in ("gpu", "igpu")

    def as_dict(self) -> dict:
        return {"index": self.index, "name": self.name, "description": self.description, "type": self.type,
                "free_bytes": self.free_bytes, "total_bytes": self.total_bytes}


def _ggml():
    """ctypes handle of the ggml library llama-cpp-python loaded, with the device API declared."""
    global _lib
    if _lib is not None:
        return _lib
    L = llama()
    path = _loaded_ggml() or _ggml_beside(os.path.join(os.path.dirname(L.__file__), "lib"))
    lib = ctypes.CDLL(path)
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
        getattr(lib, fn).restype = ctypes.c_char_p
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    # buffer types for tensor overrides (placement.py): ggml-base's, reached through libggml's handle
    lib.ggml_backend_cpu_buffer_type.argtypes = []
    lib.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_dev_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    lib.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buft_name.restype = ctypes.c_char_p
    _lib = lib
    return lib


def _loaded_ggml() -> str | None:
    """The ggml library this process already mapped (Linux). A wheel cannot hold symbolic links, so
    libggml.so, libggml.so.0 and libggml.so.0.x are three copies of one file: opening another name
    than the one llama.cpp loaded would load ggml a second time, with its own backend registry."""
    return next((p for p in mapped_libraries() if os.path.basename(p).startswith("libggml.so")), None)


def _ggml_beside(folder: str) -> str:
    """The ggml library next to libllama, by the name libllama asks for (its soname) first."""
    for pattern in ("libggml.so.0", "libggml.so*", "libggml.dylib", "libggml*.dylib", "ggml.dll"):
        names = sorted(glob.glob(os.path.join(folder, pattern)))
        if names:
            return names[0]
    raise OSError(f"no ggml library next to llama-cpp-python in {folder}")


def devices() -> list[Device]:
    """Every device llama.cpp can use, with its free and total memory now."""
    lib = _ggml()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(Device(i, (lib.ggml_backend_dev_name(dev) or b"").decode(),
                          (lib.ggml_backend_dev_description(dev) or b"").decode(),
                          DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "unknown"),
                          int(free.value), int(total.value)))
    return out


def buffer_type(device: str) -> int:
    """The ggml buffer type that puts a tensor on `device`: "CPU" (ggml's CPU buffer type, plain host
    memory), or a device name devices() lists. OSError for a name ggml does not know."""
    lib = _ggml()
    if device.upper() == "CPU":
        buft = lib.ggml_backend_cpu_buffer_type()
    else:
        dev = lib.ggml_backend_dev_by_name(device.encode())
        buft = lib.ggml_backend_dev_buffer_type(dev) if dev else None
    if not buft:
        raise OSError(f"ggml has no buffer type for device {device!r}")
    return buft


def buffer_type_name(buft: int) -> str:
    return (_ggml().ggml_backend_buft_name(buft) or b"").decode()


def gpu_free_bytes() -> int | None:
    """Free memory of the first GPU now, or None without one (for measuring a load)."""
    found = gpus()
    return found[0].free_bytes if found else None


def gpus() -> list[Device]:
    """The GPUs llama.cpp can offload to (empty on a CPU-only build or a machine without one)."""
    if not llama().llama_supports_gpu_offload():
        return []
    try:
        return [d for d in devices() if d.is_gpu]
    except OSError:
        return []
