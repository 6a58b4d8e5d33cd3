"""A file llama.cpp has not seen is loaded first where a crash cannot hurt.

llama.cpp's loader asserts (aborts the whole process) on some malformed GGUFs: a `block_count` of
0 or beyond its maximum, a vocabulary with two identical tokens, and more. Validating every field it
asserts on in Python could never be complete, and the pack lives inside someone else's process
(ComfyUI, an editor's language server), where an abort loses the user's work. So before llama.cpp
loads a file in this process:

1. `gguf_info.scan_header` checks the file's structure with every size bounded (milliseconds);
2. a vetting server (llama/vetchild.py, started once per process, standalone) forks a child that
   loads the file on the CPU, builds a small context and decodes one token. An abort, a
   segmentation fault or a timeout there becomes a `CorruptGGUF` error here, with llama.cpp's last
   words in the message.

Verdicts are cached by (real path, size, mtime), in memory and in `cache_root()/vetted.json`, so a
file is vetted once, not at every start. `A3B_VET=off` turns vetting off (for files you trust, e.g.
on a machine where starting a child process is not allowed).
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from .errors import CorruptGGUF
from .gguf_info import scan_header
from .options import cache_root, switched_off

log = logging.getLogger("a3b.vet")

#: Files larger than this are loaded but not decoded by the vetting child (a decode reads every
#: weight, which for a large model costs seconds of disk reads); override with A3B_VET_DECODE_MAX_GB.
DECODE_MAX_BYTES = int(float(os.environ.get("A3B_VET_DECODE_MAX_GB", "4")) * (1 << 30))

_lock = threading.Lock()
_verdicts: dict[tuple, dict] = {}
_server: subprocess.Popen | None = None
_disk_loaded = False
#: what vetting cost, for status and the benchmark: [(path, seconds, verdict)]
history: list[tuple[str, float, str]] = []


def enabled() -> bool:
    return not switched_off(os.environ.get("A3B_VET", "on"))


def _key(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def _disk_file() -> Path:
    return cache_root() / "vetted.json"


def _load_disk() -> None:
    global _disk_loaded
    if _disk_loaded:
        return
    _disk_loaded = True
    try:
        for item in json.loads(_disk_file().read_text()):
            _verdicts[tuple(item["key"])] = item["verdict"]
    except (OSError, ValueError, KeyError, TypeError):
        pass


def _save_disk() -> None:
    try:
        f = _disk_file()
        f.parent.mkdir(parents=True, exist_ok=True)
        items = [{"key": list(k), "verdict": v} for k, v in list(_verdicts.items())[-2000:]]
        tmp = f.with_name(f"{f.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(items))
        os.replace(tmp, f)
    except OSError as e:
        log.debug("could not save vetting verdicts: %s", e)


def _start_server() -> subprocess.Popen:
    child = Path(__file__).with_name("llama") / "vetchild.py"
    # GGML_NO_BACKTRACE: on an abort, ggml would otherwise attach gdb (when installed) to print a
    # backtrace, which takes seconds and says nothing a user can act on
    # The GPUs hidden: the vetting load runs on the CPU, and a GPU runtime initialised there would
    # hold device memory and a driver context per child for nothing.
    env = {**os.environ, "GGML_NO_BACKTRACE": "1", "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    return subprocess.Popen([sys.executable, str(child)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=str(child.parent), text=True, bufsize=1,
                            start_new_session=True, env=env)


def _ask(path: Path, size: int) -> dict:
    """One request to the vetting server (started, or restarted, on demand)."""
    global _server
    for _attempt in range(2):
        if _server is None or _server.poll() is not None:
            _server = _start_server()
        req = {"path": str(path), "decode": size <= DECODE_MAX_BYTES,
               "timeout": 120 + 10 * size / (1 << 30), "mem_limit": size + (4 << 30) + size // 4}
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


def check_file(path: str | os.PathLike) -> None:
    """Raise a typed error if llama.cpp could crash on `path`; return at once for a vetted file."""
    if not enabled():
        return
    p = Path(path)
    key = _key(p)
    v = _verdicts.get(key)
    if v is None:
        with _lock:
            _load_disk()
            v = _verdicts.get(key)
            if v is None:
                v = _vet(p, key)
    if not v.get("ok"):
        raise CorruptGGUF(_message(p, v))


def _vet(p: Path, key: tuple) -> dict:
    t0 = time.perf_counter()
    try:
        scan_header(p)   # structure first: cheap, bounded, and raises its own typed errors
    except CorruptGGUF as e:
        v = {"ok": False, "status": "structure", "log": str(e)}
    else:
        try:
            v = _ask(p, key[1])
        except (OSError, ValueError) as e:
            # vetting itself is broken here (no way to start a child): say so once and go on
            log.warning("could not vet %s in a child process (%s); loading it without that check", p.name, e)
            return {"ok": True, "unvetted": True}
    seconds = time.perf_counter() - t0
    history.append((p.name, seconds, "ok" if v.get("ok") else v.get("status", "?")))
    if v.get("status") != "timeout":   # a timeout may be a busy machine: try again next time
        _verdicts[key] = {k: v[k] for k in ("ok", "status", "signal", "log", "loads") if k in v}
        _save_disk()
    return v


def _message(p: Path, v: dict) -> str:
    if v.get("status") == "structure":
        return v.get("log", f"{p} is not a valid GGUF.")
    lines = [ln.strip() for ln in (v.get("log") or "").splitlines() if ln.strip()]
    said = [ln for ln in lines if "assert" in ln.lower() or "error" in ln.lower() or "fail" in ln.lower()]
    detail = " | ".join((said or lines)[-2:]) or "no message"
    detail = re.sub(r"\S*/(?=[\w.-]+\.(?:cpp|c|h):\d+)", "", detail)   # the build folder says nothing
    if v.get("status") == "timeout":
        return (f"llama.cpp did not finish loading {p.name} within the time limit ({detail}). The file may be "
                "damaged; if it is a very large model on a busy machine, set A3B_VET=off to skip this check.")
    how = f"signal {v['signal']}" if v.get("signal") else f"exit code {v.get('exit_code')}"
    return (f"{p.name} makes llama.cpp's loader crash ({how}: {detail}). The file is damaged or malformed; "
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
