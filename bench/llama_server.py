"""llama.cpp's llama-server for benchmarks and tests, built once from the sources in
llama-cpp-python's source distribution.

llama-cpp-python's wheel holds llama.cpp as a library only; its source distribution vendors the
whole llama.cpp tree at the commit the binding was made for, server included. Built from there,
llama-server runs the same llama.cpp as the runtime, so comparisons and tests see one version.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


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
