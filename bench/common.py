"""Shared benchmark plumbing: a printed table, a JSON file and a PNG plot under bench/results/.

Machines here are shared and noisy, so every benchmark measures its baseline in the same run and
reports ratios; absolute figures are for orientation only.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    try:
        import llama_cpp  # noqa: F401
        import importlib.metadata

        lcp = importlib.metadata.version("llama-cpp-python")
    except Exception:  # noqa: BLE001 - machine info is best effort; a broken llama_cpp must not stop a run
        lcp = None
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "llama_cpp_python": lcp, "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    sys.stdout.flush()


def write_results(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "machine": machine(), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=float))
    print(f"wrote {path.relative_to(RESULTS.parent.parent)}")
    return path


def plot(name: str, draw: Callable[[Any], None], size=(7, 4)) -> Path:
    """Call `draw(ax)` on a fresh matplotlib axis and save bench/results/<name>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=size)
    draw(ax)
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path.relative_to(RESULTS.parent.parent)}")
    return path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: llama_cpp.server as is, except that models load without llama.cpp's CPU weight repacking (for a
#: build whose repacking crashes on this processor, see runtime/vet.py; Llama() has no option for it)
_SERVER_NO_REPACK = ("import runpy\n"
                     "import llama_cpp.llama_cpp as C\n"
                     "_defaults = C.llama_model_default_params\n"
                     "def _params():\n"
                     "    p = _defaults()\n"
                     "    p.use_extra_bufts = False\n"
                     "    return p\n"
                     "C.llama_model_default_params = _params\n"
                     "runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)\n")


def llama_cpp_server() -> list[str]:
    """The command that starts llama-cpp-python's OpenAI server (its options follow), on any build."""
    from ..runtime import vet

    return [sys.executable, "-m", "llama_cpp.server"] if vet.repack_allowed() else [sys.executable, "-c",
                                                                                    _SERVER_NO_REPACK]


def with_chat_template(src: str | Path, dst: str | Path, template: str) -> Path:
    """A copy of the GGUF `src` whose chat template is `template` (weights and vocabulary as they
    are): the embedded model made to speak another template's shape, for benchmarks and tests."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata, get_field_data

    reader = gguf.GGUFReader(str(src), "r")
    writer = gguf.GGUFWriter(str(dst), arch=get_field_data(reader, gguf.Keys.General.ARCHITECTURE),
                             endianess=reader.endianess)
    alignment = get_field_data(reader, gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment
    copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(
        gguf.GGUFValueType.STRING, template)}, [])
    return Path(dst)
