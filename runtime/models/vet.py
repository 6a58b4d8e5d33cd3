"""A file llama.cpp has not seen is loaded first where a crash cannot hurt.

llama.cpp's loader asserts (aborts the whole process) on some malformed GGUFs: a `block_count` of
0 or beyond its maximum, a vocabulary with two identical tokens, and more. Validating every field it
asserts on in Python could never be complete, and the pack lives inside someone else's process
(ComfyUI, an editor's language server), where an abort loses the user's work. So before llama.cpp
loads a file in this process:

1. `ggufscan.scan_header` checks the file's structure with every size bounded (milliseconds);
2. a vetting server (llama/vetchild.py, started once per process, standalone) forks a child that
   loads the file on the CPU, builds a small context and decodes one token. An abort, a
   segmentation fault or a timeout there becomes a `CorruptGGUF` error here, with llama.cpp's last
   words in the message.

Verdicts are cached by (real path, size, mtime), in memory and in `cache_root()/vetted.json`, so a
file is vetted once, not at every start. `A3B_VET=off` turns vetting off (for files you trust, e.g.
on a machine where starting a child process is not allowed).

A crash is not always the file's fault. llama.cpp's CPU backend copies weights into interleaved
layouts ("repacking", extra buffer types) whose kernels use the newest instructions the build was
compiled for: a build made with `-march=native` on a processor that advertises AMX to the compiler
but whose system does not allow it (seen in virtual machines) dies in `ldtilecfg` on the first
matrix product of any quantised model. So a decode that dies of a signal is tried once more without
repacking; if that works, repacking is broken for this llama.cpp build on this processor (not for
the file): the verdict is kept per build and processor, every later load goes without repacking
(`repack_allowed()`: the same results through llama.cpp's plain CPU kernels; a warning names a
build that can repack), and files too large to be decoded while vetting learn it from the embedded
model first. `A3B_CPU_REPACK=off` turns repacking off by hand.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..errors import CorruptGGUF
from .ggufscan import scan_header
from ..environment import env_number, env_on
from ..llama.binding import library_dir
from ..options import cache_root

log = logging.getLogger("a3b.vet")


def decode_max_bytes() -> int:
    """Files larger than this are loaded but not decoded by the vetting child (a decode reads every
    weight, which for a large model costs seconds of disk reads): A3B_VET_DECODE_MAX_GB."""
    return int(env_number("A3B_VET_DECODE_MAX_GB") * (1 << 30))


#: projectors up to this size encode one small image while vetted (a CPU encode with one thread of
#: a large vision tower takes seconds); larger ones are loaded only
MMPROJ_ENCODE_MAX_BYTES = 256 << 20

#: the first item of the keys of verdicts on the llama.cpp build and processor (not on a file)
BUILD_VERDICT = "cpu-repack"
#: verdicts of files kept on disk (their logs are kept only for files that failed)
MAX_FILE_VERDICTS = 2000

_lock = threading.Lock()
_server: subprocess.Popen | None = None
#: what vetting cost, for status and the benchmark: [(path, seconds, verdict)]
history: list[tuple[str, float, str]] = []
#: how a CPU kernel dies: an instruction the system does not allow, a bad address
KERNEL_SIGNALS = ("SIGSEGV", "SIGILL", "SIGBUS")
#: The folders before a source file named in llama.cpp's log ("/build/ggml/src/ggml.c:12" -> "ggml.c:12").
#: Tried only where a run of non-blanks starts: from every position of a long run, `\S*` would scan
#: to its end again (quadratic in the run, which a file's own metadata can make as long as it likes).
_SOURCE_DIR = re.compile(r"(?<!\S)\S*/(?=[\w.-]+\.(?:cpp|c|h):\d+)")
REBUILD_HINT = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install '
                '--force-reinstall --no-cache-dir llama-cpp-python')


def enabled() -> bool:
    return env_on("A3B_VET")


def _key(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _build_key() -> tuple:
    """Whether CPU repacking works depends on the llama.cpp build and the processor as the system
    presents it (its model and flags), not on the file: the key of that verdict."""
    import hashlib

    lib = library_dir() or Path("?")
    try:
        stamp = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in lib.iterdir())
    except OSError:
        lib, stamp = Path("?"), []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        cpu = []
    digest = hashlib.sha256(repr((stamp, cpu)).encode()).hexdigest()[:16]
    return (BUILD_VERDICT, str(lib), 0, digest)


def repack_allowed() -> bool:
    """False where llama.cpp's CPU repacking crashed with this build on this processor (see the
    module docstring) or `A3B_CPU_REPACK=off`; loads then keep the weights in the file's layout.
    Not known yet for this build: learnt once from the embedded model in the vetting server."""
    if not env_on("A3B_CPU_REPACK"):
        return False
    # also with A3B_VET=off: that trusts the files, and a broken build crashes on every trusted file
    with _lock:
        VERDICTS.load_disk()
        build = _build_key()
        if build not in VERDICTS:  # verdicts of files vetted before this was known say nothing about it
            _learn_repack(None)
        v = VERDICTS.get(build)
    return not (v is not None and v.get("repack") is False)


class Verdicts(dict):
    """This process's vetting verdicts by key (a file's or a build's), backed by
    `cache_root()/vetted.json`, which is read at the first need (`load_disk`)."""

    def __init__(self) -> None:
        super().__init__()
        self.disk_loaded = False

    @staticmethod
    def disk_file() -> Path:
        return cache_root() / "vetted.json"

    def load_disk(self) -> None:
        if self.disk_loaded:
            return
        self.disk_loaded = True
        try:
            for item in json.loads(self.disk_file().read_text()):
                self[tuple(item["key"])] = item["verdict"]
        except (OSError, ValueError, KeyError, TypeError):
            pass

    def save_disk(self) -> None:
        """Write the verdicts: every verdict of the build (kept whatever the number of files, or
        every process after many vetted files would learn them again) and the newest
        `MAX_FILE_VERDICTS` verdicts of files that still exist."""
        try:
            f = self.disk_file()
            f.parent.mkdir(parents=True, exist_ok=True)
            kept = [(k, v) for k, v in list(self.items()) if k[0] == BUILD_VERDICT]
            kept += [(k, v) for k, v in list(self.items()) if k[0] != BUILD_VERDICT and os.path.exists(k[0])
                     ][-MAX_FILE_VERDICTS:]
            items = [{"key": list(k), "verdict": v} for k, v in kept]
            tmp = f.with_name(f"{f.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps(items))
            os.replace(tmp, f)
        except OSError as e:
            log.debug("could not save vetting verdicts: %s", e)

    def reset(self) -> None:
        """Forget what is in memory: the verdicts as a new process starts with them (from disk at first need)."""
        self.clear()
        self.disk_loaded = False


#: the process's verdicts
VERDICTS = Verdicts()


def _start_server() -> subprocess.Popen:
    child = Path(__file__).parent.parent / "llama" / "vetchild.py"
    # GGML_NO_BACKTRACE: on an abort, ggml would otherwise attach gdb (when installed) to print a
    # backtrace, which takes seconds and says nothing a user can act on
    # The GPUs hidden: the vetting load runs on the CPU, and a GPU runtime initialised there would
    # hold device memory and a driver context per child for nothing.
    env = {**os.environ, "GGML_NO_BACKTRACE": "1", "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    return subprocess.Popen([sys.executable, str(child)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=str(child.parent), text=True, bufsize=1,
                            start_new_session=True, env=env)


def _ask(path: Path, size: int, repack: bool = True, kind: str = "model", base: Path | None = None) -> dict:
    """One request to the vetting server (started, or restarted, on demand). `base`: the model an
    adapter or a projector is loaded over in the child (it was vetted itself before)."""
    global _server
    base_size = base.stat().st_size if base is not None else 0
    for _attempt in range(2):
        if _server is None or _server.poll() is not None:
            _server = _start_server()
        decode = size <= (decode_max_bytes() if kind == "model" else MMPROJ_ENCODE_MAX_BYTES)
        if kind == "lora":   # a decode over the base with the adapter applied: the base's size decides
            decode = base_size <= decode_max_bytes()
        total = size + base_size
        req = {"path": str(path), "decode": decode, "repack": repack, "kind": kind,
               "timeout": 120 + 10 * total / (1 << 30), "mem_limit": total + (4 << 30) + total // 4}
        if base is not None:
            req["base"] = str(base)
        try:
            _server.stdin.write(json.dumps(req) + "\n")
            _server.stdin.flush()
            line = _server.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if line:
            return json.loads(line)
        _server = None   # it died (it should not): start a new one and ask once more
    raise OSError("the vetting server stopped answering")


def _ask_repack_aware(p: Path, size: int) -> dict:
    """Vet `p` as the host will load it; a decode that dies of a signal with repacking is tried
    again without it, and if that works, repacking is marked broken for this build (module docstring)."""
    build = _build_key()
    known = VERDICTS.get(build, {}).get("repack")
    decode = size <= decode_max_bytes()
    if known is None and not decode:
        _learn_repack(p)   # the decode that would show it is skipped for this file: learn it elsewhere
        known = VERDICTS.get(build, {}).get("repack")
    if known is False:
        return _ask(p, size, repack=False)
    v = _ask(p, size, repack=True)
    if v.get("ok") and v.get("decoded"):
        # only the embedded model says that repacking works: a float file has nothing to repack, and
        # a file of another type may not reach the kernels that crash
        if _is_canary(p):
            _record_repack(True)
    elif not v.get("ok") and decode and v.get("signal") in KERNEL_SIGNALS:
        plain = _ask(p, size, repack=False)
        if plain.get("ok") and plain.get("decoded"):
            _record_repack(False, f"{v.get('signal')} in the first decode")
            return plain
    return v


def _canary() -> Path | None:
    """The embedded model (Q4_1, a type llama.cpp repacks): the file that tells whether repacking works."""
    try:
        from .locate import default_model_path

        return default_model_path().resolve()
    except Exception:  # noqa: BLE001 - not installed: nothing to learn from
        return None


def _is_canary(p: Path) -> bool:
    c = _canary()
    return c is not None and Path(p).resolve() == c


def _learn_repack(p: Path | None) -> None:
    """Decode the embedded model (small) once to learn whether repacking works with this build."""
    canary = _canary()
    try:
        if canary is None or (p is not None and Path(p).resolve() == canary):
            return
        size = canary.stat().st_size
        if size <= decode_max_bytes():
            _ask_repack_aware(canary, size)
    except (OSError, ValueError) as e:  # no child process here: the file is vetted as before
        log.debug("could not learn whether CPU repacking works: %s", e)


def _record_repack(works: bool, why: str = "") -> None:
    build = _build_key()
    if VERDICTS.get(build, {}).get("repack") is works:
        return
    VERDICTS[build] = {"ok": True, "repack": works, "log": why}
    if not works:
        log.warning("llama.cpp crashed in its CPU weight repacking on this processor (%s): the installed "
                    "llama-cpp-python was probably built for CPU features this system does not allow (AMX in a "
                    "virtual machine, for one). Models load without repacking from now on: the same results, "
                    "through llama.cpp's plain CPU kernels. A build without those features repacks again: %s",
                    why or "a CPU kernel died", REBUILD_HINT)
    VERDICTS.save_disk()


def check_file(path: str | os.PathLike, kind: str = "model", base: str | os.PathLike | None = None) -> None:
    """Raise a typed error if llama.cpp could crash on `path`; return at once for a vetted file.
    `kind`: "model" (a llama_model); "mmproj" (a multimodal projector, loaded by libmtmd's clip
    loader in the child over the text model `base`, which encodes one small image with it where the
    file is small); "lora" (an adapter, loaded over the model `base`, one token decoded with it
    applied where the base is small). Verdicts of the last two are kept per (file, base)."""
    if not enabled():
        return
    p = Path(path)
    b = Path(base) if base is not None else None
    # a file is vetted for what it is loaded as: a model's verdict says nothing of the clip loader
    key = _key(p) + ((kind,) if kind != "model" else ()) + (_key(b) if b is not None else ())
    v = VERDICTS.get(key)
    if v is None:
        # an adapter's decode runs over the base as the host loads it (a CPU without working repacking
        # would crash the trial whatever the adapter); asked before the lock, which this takes too
        repack = repack_allowed() if kind == "lora" else True
        with _lock:
            VERDICTS.load_disk()
            v = VERDICTS.get(key)
            if v is None:
                v = _vet(p, key, kind, b, repack)
    if not v.get("ok"):
        raise CorruptGGUF(_message(p, v, kind))


def check_adapter(path: str | os.PathLike, base: str | os.PathLike) -> None:
    """A LoRA adapter tried over `base` in the child before llama.cpp reads it here (check_file)."""
    check_file(path, kind="lora", base=base)


def _vet(p: Path, key: tuple, kind: str = "model", base: Path | None = None, repack: bool = True) -> dict:
    t0 = time.perf_counter()
    try:
        scan_header(p)   # structure first: cheap, bounded, and raises its own typed errors
    except CorruptGGUF as e:
        v = {"ok": False, "status": "structure", "log": str(e)}
    else:
        try:
            v = (_ask(p, key[1], repack=repack, kind=kind, base=base) if kind != "model"
                 else _ask_repack_aware(p, key[1]))
        except (OSError, ValueError) as e:
            # vetting itself is broken here (no way to start a child): say so once and go on
            log.warning("could not vet %s in a child process (%s); loading it without that check", p.name, e)
            return {"ok": True, "unvetted": True}
    seconds = time.perf_counter() - t0
    history.append((p.name, seconds, "ok" if v.get("ok") else v.get("status", "?")))
    if v.get("status") != "timeout":   # a timeout may be a busy machine: try again next time
        # llama.cpp's last words are kept for the message of a file that failed; a vetted file's say nothing
        VERDICTS[key] = {k: v[k] for k in ("ok", "status", "signal", "log", "loads")
                         if k in v and (k != "log" or not v.get("ok"))}
        VERDICTS.save_disk()
    return v


def _message(p: Path, v: dict, kind: str = "model") -> str:
    if v.get("status") == "structure":
        return v.get("log", f"{p} is not a valid GGUF.")
    lines = [ln.strip() for ln in (v.get("log") or "").splitlines() if ln.strip()]
    said = [ln for ln in lines if "assert" in ln.lower() or "error" in ln.lower() or "fail" in ln.lower()]
    detail = " | ".join((said or lines)[-2:]) or "no message"
    detail = _SOURCE_DIR.sub("", detail)   # the build folder says nothing
    if v.get("status") == "timeout":
        return (f"llama.cpp did not finish loading {p.name} within the time limit ({detail}). The file may be "
                "damaged; if it is a very large model on a busy machine, set A3B_VET=off to skip this check.")
    how = f"signal {v['signal']}" if v.get("signal") else f"exit code {v.get('exit_code')}"
    what = {"lora": "llama.cpp crash when loaded as a LoRA adapter and used for one token",
            "mmproj": "llama.cpp crash when loaded as a projector and used to encode a small image"
            }.get(kind, "llama.cpp's loader crash")
    return (f"{p.name} makes {what} ({how}: {detail}). The file is damaged or malformed; "
            "download or convert it again. It was tried in a separate process, so nothing else was affected.")


def shutdown() -> None:
    """Stop the vetting server (it also ends by itself when this process exits)."""
    global _server
    s, _server = _server, None
    if s is not None and s.poll() is None:
        try:
            s.stdin.close()
            s.wait(2)
        except (OSError, subprocess.TimeoutExpired):
            s.kill()


def backend_sampling_works(repack: bool) -> tuple[bool, bool]:
    """(Whether llama.cpp's backend sampler chains run with this build on this processor, whether
    they also measure a row's entropy inside the graph as the CPU computes it: llama/graph_entropy.py),
    with the weights repacked for the CPU or not: learnt once per build from the embedded model in the
    vetting server (a chain attached to a context whose weights sit in AMX buffers crashed in the AMX
    matrix product of the first decode) and kept with the other verdicts. No child process possible or
    no embedded model: (False, False) (the CPU chain, as before)."""
    v = _sampling_verdict(repack)
    return bool(v.get("works")), bool(v.get("works") and v.get("entropy"))


def _sampling_verdict(repack: bool) -> dict:
    key = _build_key() + ("backend_sampling", bool(repack), "entropy")
    with _lock:
        VERDICTS.load_disk()
        v = VERDICTS.get(key)
        if v is None:
            canary = _canary()
            if canary is None:
                return {}
            try:
                v = _ask(canary, canary.stat().st_size, repack=repack, kind="sampling")
            except (OSError, ValueError) as e:
                log.debug("could not probe backend sampling: %s", e)
                return {}
            if v.get("status") == "timeout":
                return {}   # a busy machine, maybe: ask again next time
            v = {"ok": True, "works": bool(v.get("ok") and v.get("works")), "entropy": bool(v.get("entropy")),
                 "log": v.get("why") or v.get("signal") or v.get("status") or ""}
            VERDICTS[key] = v
            VERDICTS.save_disk()
            if not v["works"]:
                log.info("backend sampling does not work with this llama.cpp build%s (%s): the CPU sampler "
                         "draws every token", " over repacked weights" if repack else "", v["log"])
    return v
