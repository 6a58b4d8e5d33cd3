"""`a3b doctor`: what is installed and whether it works, one line per check (Python, llama.cpp's build
and devices, the C++ runtime, the default model, a load, a generation and an embedding)."""
from __future__ import annotations

import sys
import time


def cmd_doctor(args) -> int:
    """Each check catches whatever its step raises and reports it in its line: a broken installation
    is what doctor is for, and every check should run rather than stop at the first failure."""
    import platform

    lines: list[tuple[str, str, bool]] = [("python", f"{platform.python_version()} ({sys.executable})", True)]
    ok_all = True
    try:
        from .runtime.llama import system_info

        si = system_info()
        lines.append(("llama-cpp-python", si["llama_cpp_python"], True))
        lines.append(("llama.cpp build", si["system_info"], True))
        lines.append(("GPU offload compiled in", "yes" if si["gpu_offload"] else
                      "no (CPU only build; the README's GPU section says how to install a CUDA build)", True))
        from .runtime.llama.cxxruntime import carriers

        own = carriers()
        lines.append(("C++ runtime", f"{', '.join(own)} carry their own copy: safe only where llama.cpp loads "
                      "before torch and numpy (docs/gpu.md)" if own else "shared with the system's (fine)", True))
        from .runtime.llama.devices import devices

        for d in devices():
            if d.type != "cpu":
                lines.append((f"device {d.name}", f"{d.description} ({d.type}), {d.free_bytes / 2**30:.1f} GiB free "
                              f"of {d.total_bytes / 2**30:.1f} GiB", True))
    except Exception as e:  # noqa: BLE001  (a failed check, reported in its line)
        lines.append(("llama-cpp-python", str(e), False))
        ok_all = False
    try:
        from .runtime import default_model_path, inspect_gguf

        p = default_model_path()
        info = inspect_gguf(p)
        lines.append(("default model", f"{p} ({info.architecture}, {info.file_type}, {info.file_size / 1e6:.0f} MB)",
                      True))
    except Exception as e:  # noqa: BLE001  (a failed check, reported in its line)
        lines.append(("default model", str(e), False))
        ok_all = False
    if ok_all:
        try:
            from .runtime import get_runtime, preset

            rt = get_runtime()
            t0 = time.perf_counter()
            rt.load()
            load_s = time.perf_counter() - t0
            res = rt.generate("Say hello.", max_tokens=16, sampling=preset("greedy"))
            measured = rt.load().info.placement.get("measured", {}).get("gpu_bytes")
            lines.append(("model load", f"{load_s * 1000:.0f} ms; {rt.load().info.offload}"
                          + (f"; measured {measured / 2**30:.2f} GiB on the GPU" if measured else ""), True))
            lines.append(("generation", (f"{res.n_tokens} tokens at {res.tokens_per_second:.0f} tokens/s, "
                          f"first token after {res.time_to_first_token * 1000:.0f} ms: {res.text.strip()[:60]!r}"),
                          res.n_tokens > 0))
            vec = rt.embed(["hello"])
            lines.append(("embedding", f"dim {vec.shape[1]}", True))
        except Exception as e:  # noqa: BLE001  (a failed check, reported in its line)
            lines.append(("generation", f"{type(e).__name__}: {e}", False))
            ok_all = False
    for name, value, ok in lines:
        print(f"{'ok ' if ok else 'ERR'} {name:24} {value}")
    return 0 if ok_all and all(ok for *_, ok in lines) else 1
