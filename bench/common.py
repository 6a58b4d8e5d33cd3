"""The benchmarks' harness: their command lines (a parser described by the benchmark's docstring,
the model option, --name and --report), their output (a printed table, a JSON file with the
machine's description and a PNG plot under bench/results/), and the servers benchmarks and tests
compare against (llama_cpp.server; llama.cpp's llama-server, built once from the sources in
llama-cpp-python's source distribution). Random-weight models are written by models.py.

Machines here are shared and noisy, so every benchmark measures its baseline in the same run and
reports ratios; absolute figures are for orientation only.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
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


def execute(ap: argparse.ArgumentParser, argv: Sequence[str] | None, measure: Callable[[argparse.Namespace], dict],
        report: Callable[[dict], None]) -> int:
    """A benchmark with --name and --report: an earlier run shown again, or `measure(args)` written to
    bench/results/<name>.json and shown by `report` (its table and plot); 0."""
    args = ap.parse_args(argv)
    if reported(args, report):
        return 0
    return publish(args.name, measure(args), report)


# -- output -------------------------------------------------------------------------------------------
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


# -- llama.cpp's llama-server ------------------------------------------------------------------------------
# llama-cpp-python's wheel holds llama.cpp as a library only; its source distribution vendors the
# whole llama.cpp tree at the commit the binding was made for, server included. Built from there,
# llama-server runs the same llama.cpp as the runtime, so comparisons and tests see one version.

#: cmake options of the build: the server alone, static, without downloading (curl) or TLS
LLAMA_SERVER_CMAKE = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
                      "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                      "-DBUILD_SHARED_LIBS=OFF")
#: how long a second process waits for another one's build of the same version
BUILD_WAIT_S = 3600.0


class BuildToolsMissing(RuntimeError):
    """cmake or a C or C++ compiler is not on PATH, so llama-server cannot be built here."""


def _llama_cpp_python_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("llama-cpp-python")


def llama_server_path() -> Path:
    """Where llama-server for the installed llama-cpp-python is cached (it may not be built yet):
    <cache folder>/llama-server/<llama-cpp-python version>/llama-server."""
    from ..runtime.options import cache_root

    name = "llama-server.exe" if os.name == "nt" else "llama-server"
    return cache_root() / "llama-server" / _llama_cpp_python_version() / name


def missing_build_tools() -> list[str]:
    """What of cmake, a C compiler and a C++ compiler is not found on PATH ($CC and $CXX first)."""
    def found(env: str, names: tuple[str, ...]) -> bool:
        given = os.environ.get(env)
        return any(shutil.which(n) for n in ((given,) if given else names))

    missing = [] if shutil.which("cmake") else ["cmake"]
    if not found("CC", ("cc", "gcc", "clang", "cl")):
        missing.append("a C compiler")
    if not found("CXX", ("c++", "g++", "clang++", "cl")):
        missing.append("a C++ compiler")
    return missing


def _runs(binary: Path) -> bool:
    if not binary.is_file():
        return False
    try:
        return subprocess.run([str(binary), "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@contextlib.contextmanager
def _exclusive(path: Path, wait_s: float):
    """An exclusive lock on the file `path` between processes, waited for at most `wait_s`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        if os.name == "nt":
            import msvcrt

            def take() -> None:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)

            def release() -> None:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            def take() -> None:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)

            def release() -> None:
                fcntl.flock(f, fcntl.LOCK_UN)
        t_end = time.monotonic() + wait_s
        while True:
            try:
                take()
                break
            except OSError:
                if time.monotonic() > t_end:
                    raise TimeoutError(f"{path} stayed locked for {wait_s:.0f} s (another build of "
                                       "llama-server)") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            release()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def llama_server_binary(say: Callable[[str], None] = _stderr) -> Path:
    """llama-server for the installed llama-cpp-python: the cached build, or built now.

    The first call downloads llama-cpp-python's source distribution from PyPI (pip) and builds its
    vendored llama.cpp with cmake, several minutes on a small machine; `say` tells so once. Builds
    are serialised by a lock file, so two processes never build the same version twice, and the
    binary is renamed into place only when complete. BuildToolsMissing when cmake or a compiler is
    missing; RuntimeError, naming the build log, when a step fails."""
    target = llama_server_path()
    if _runs(target):
        return target
    missing = missing_build_tools()
    if missing:
        named = ", ".join(missing[:-1]) + " and " + missing[-1] if len(missing) > 1 else missing[0]
        raise BuildToolsMissing(f"building llama-server needs {named} on PATH")
    with _exclusive(target.parent / "build.lock", BUILD_WAIT_S):
        if _runs(target):   # built by another process while this one waited
            return target
        say(f"building llama-server {_llama_cpp_python_version()} from llama-cpp-python's sources into "
            f"{target.parent}: this takes several minutes, once (log: {target.parent / 'build.log'})")
        t0 = time.monotonic()
        _build(target)
        say(f"llama-server built in {time.monotonic() - t0:.0f} s")
    return target


def _build(target: Path) -> None:
    version = _llama_cpp_python_version()
    work = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    log_path = target.parent / "build.log"
    try:
        with open(log_path, "wb") as log:
            def step(*cmd: str | Path) -> None:
                log.write(f"$ {' '.join(map(str, cmd))}\n".encode())
                log.flush()
                rc = subprocess.run([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}).returncode
                if rc != 0:
                    raise RuntimeError(f"building llama-server failed: {Path(str(cmd[0])).name} exited with "
                                       f"status {rc}; see {log_path}")

            step(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={version}", "-d", work / "sdist")
            sdists = sorted((work / "sdist").glob("*.tar.gz"))
            if len(sdists) != 1:
                raise RuntimeError(f"pip download left {len(sdists)} source archives, not one; see {log_path}")
            src = _extract_vendored(sdists[0], work / "src")
            jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 2)
            step("cmake", "-S", src, "-B", work / "build", *LLAMA_SERVER_CMAKE)
            step("cmake", "--build", work / "build", "--config", "Release", "--target", "llama-server", "-j", jobs)
        built = [p for p in (work / "build" / "bin" / target.name, work / "build" / "bin" / "Release" / target.name)
                 if p.is_file()]
        if not built:
            raise RuntimeError(f"the build finished without {target.name} under build/bin; see {log_path}")
        partial = target.with_name(target.name + ".partial")
        shutil.copy2(built[0], partial)
        partial.chmod(0o755)
        os.replace(partial, target)
        log_path.unlink(missing_ok=True)   # megabytes of compiler output, kept only when a step fails
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _extract_vendored(sdist: Path, into: Path) -> Path:
    """Extract only vendor/llama.cpp/ of the source archive; its path."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.split("/", 1)[-1].startswith("vendor/llama.cpp/")]
        if not members:
            raise RuntimeError(f"{sdist.name} holds no vendor/llama.cpp/")
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(into, members=members, **kwargs)
    return into / members[0].name.split("/", 1)[0] / "vendor" / "llama.cpp"


def llama_server_command(binary: str | os.PathLike) -> list[str]:
    """The command that starts `binary` (llama-server; its options follow), on any processor: without
    CPU weight repacking where it crashes (runtime/models/vet.py; llama-server built from the same
    llama.cpp crashes the same way)."""
    from ..runtime.models import vet

    return [str(binary)] + ([] if vet.repack_allowed() else ["--no-repack"])
