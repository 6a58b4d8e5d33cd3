"""The benchmarks' harness: their command lines (a parser described by the benchmark's docstring,
the model option, --name and --report), their output (a printed table, a JSON file with the
machine's description and a PNG plot under bench/results/), and the servers benchmarks and tests
compare against (llama_cpp.server; llama.cpp's llama-server, built once from the sources in
llama-cpp-python's source distribution: llama_server.py). Random-weight models are written by
models.py.

Machines here are shared and noisy, so every benchmark measures its baseline in the same run and
reports ratios; absolute figures are for orientation only.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# benchmarks and tests take llama-server from the harness
from .llama_server import BuildToolsMissing, llama_server_binary, llama_server_command  # noqa: F401

RESULTS = Path(__file__).resolve().parent / "results"


# -- command lines --------------------------------------------------------------------------------------
def arguments(doc: str, name: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser, described by the first paragraph of its docstring; with `name`, its
    results options (--name, defaulting to `name`, and --report)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if name is not None:
        results_options(ap, name)
    return ap


def model_option(ap: argparse.ArgumentParser, *, positional: bool = False, default: str | None = None,
                 help: str = "the GGUF to measure (default: the embedded model)", **kw) -> None:
    """The GGUF a benchmark measures: `model` (positional, optional) or --model."""
    if positional:
        ap.add_argument("model", nargs="?", default=default, help=help, **kw)
    else:
        ap.add_argument("--model", default=default, help=help, **kw)


def model_path(given: str | os.PathLike | None) -> Path:
    """The model given, or the embedded default model."""
    if given:
        return Path(given)
    from ..runtime import default_model_path

    return default_model_path()


def report_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--report", metavar="JSON", help="only print the table and draw the plot of an earlier run")


def name_option(ap: argparse.ArgumentParser, name: str) -> None:
    """--name: the benchmark's results file name under bench/results (default `name`)."""
    ap.add_argument("--name", default=name, help="results name under bench/results")


def results_options(ap: argparse.ArgumentParser, name: str) -> None:
    """A benchmark's --name (its results under bench/results) and --report (an earlier run again)."""
    name_option(ap, name)
    report_option(ap)


def earlier(args) -> dict | None:
    """With --report: the earlier run's results (its "name" filled in from --name where it has none)."""
    if not getattr(args, "report", None):
        return None
    res = json.loads(Path(args.report).read_text())
    if hasattr(args, "name"):
        res["name"] = res.get("name", args.name)
    return res


def reported(args, report: Callable[[dict], None]) -> bool:
    """With --report: the earlier run's table and plot (`report`), and True."""
    res = earlier(args)
    if res is None:
        return False
    report(res)
    return True


def command(module: str, argv: Sequence[str] | None) -> str:
    """The command line of this run of `module` (bench_...), for its results."""
    given = sys.argv[1:] if argv is None else argv
    return " ".join([f"python -m comfyui_a3b.bench.{module}", *given])


def execute(ap: argparse.ArgumentParser, argv: Sequence[str] | None,
            measure: Callable[[argparse.Namespace], dict], report: Callable[[dict], None]) -> int:
    """A benchmark with --name and --report: an earlier run shown again, or `measure(args)` written to
    bench/results/<name>.json and shown by `report` (its table and plot); 0."""
    args = ap.parse_args(argv)
    if reported(args, report):
        return 0
    return publish(args.name, measure(args), report)


# -- output -------------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    try:
        import llama_cpp  # noqa: F401
        import importlib.metadata

        lcp = importlib.metadata.version("llama-cpp-python")
    except Exception:  # noqa: BLE001 - machine info is best effort; a broken llama_cpp must not stop a run
        lcp = None
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "llama_cpp_python": lcp, "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def device_label() -> str:
    """The first GPU llama.cpp sees, by its description, or "CPU" (a label for results only)."""
    try:
        from comfyui_a3b.runtime.llama.devices import gpus

        found = gpus()
        return found[0].description if found else "CPU"
    except Exception:  # noqa: BLE001 - a label only
        return "CPU"


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


def publish(name: str, res: dict, report: Callable[[dict], None]) -> int:
    """`res` written to bench/results/<name>.json, then shown by `report` (which finds `name` in it); 0."""
    write_results(name, res)
    report({**res, "name": res.get("name", name)})
    return 0


def ratio(value: float, baseline: float) -> float:
    """`value` over the same run's `baseline` (nan without a baseline)."""
    return value / baseline if baseline else float("nan")


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


# -- servers and models -------------------------------------------------------------------------------
def in_threads(fn: Callable[[int], Any], n: int) -> float:
    """fn(0) ... fn(n - 1), each in a thread of its own, all at once; the wall seconds until all ended."""
    threads = [threading.Thread(target=fn, args=(k,)) for k in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: llama_cpp.server as is, except that models load without llama.cpp's CPU weight repacking (for a
#: build whose repacking crashes on this processor, see runtime/models/vet.py; Llama() has no option for it)
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
    from ..runtime.models import vet

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
