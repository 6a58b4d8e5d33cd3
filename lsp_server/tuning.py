"""The command a3b.tuneWorkspace: `a3b tune` on the workspace, in the background, then its adapter.

`a3b.tuneWorkspace([folder], [options])` starts `a3b tune FOLDER --model <this editor's model>
--progress-json` in a child process at low CPU priority (nice 10), so the editor, the model and the
machine stay responsive, and never on the event loop's thread: the child's JSON lines are read as
they come. Progress is LSP work-done progress (step, loss, held-out loss) when the client supports
it. `options` are `a3b tune`'s flags in camelCase ({"steps": 200, "seqLen": 256}); the child checks
them against their declarations, and a refusal comes back as the command's error.

When the child is done, the adapter is used for this editor (the `lora` setting) if its held-out
loss is lower than the base model's and lower than the held-out loss recorded in the adapter in use,
where that one was measured on the same held-out files; a message says by how much. Cancelling the
command stops the child. The adapter goes into the cache folder (adapters/), one per workspace and
model, so tuning again replaces it (and resumes it when the settings are the same).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from lsprotocol import types as T

from ..runtime import adapters
from ..runtime.errors import A3BError, InvalidRequest
from ..runtime.options import cache_root

#: niceness of the child: below the editor and the model's own threads
NICE = 10
#: a progress report at most this often (seconds)
REPORT_EVERY = 0.5
#: the last lines of the child's stderr kept for an error message
STDERR_LINES = 20


class TuneFailed(A3BError):
    code = "tune_failed"


def adapter_path(root: Path, model: Path) -> Path:
    tag = hashlib.sha256(str(root).encode()).hexdigest()[:10]
    return cache_root() / "adapters" / f"{root.name or 'workspace'}-{tag}.{model.stem}.lora.gguf"


def _flag(key: str) -> str:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{0,40}", key):
        raise InvalidRequest(f"a3b.tuneWorkspace: {key!r} is not an option name.")
    return "--" + re.sub(r"(?<!^)([A-Z])", r"-\1", key).lower()


def command_line(root: Path, model: str, out: Path, options: dict[str, Any]) -> list[str]:
    exe = shutil.which("a3b")
    argv = [exe] if exe else [sys.executable, "-m", "comfyui_a3b.cli"]
    argv += ["tune", str(root), "--model", model, "--out", str(out), "--progress-json"]
    for key, value in options.items():
        if isinstance(value, bool):
            argv += [_flag(key)] if value else []
        elif isinstance(value, (int, float, str)):
            argv += [_flag(key), str(value)]
        else:
            raise InvalidRequest(f"a3b.tuneWorkspace: option {key!r} must be a number, text or true, got {value!r}.")
    return argv


def _lower_priority() -> None:   # runs in the child before exec
    with contextlib.suppress(OSError):
        os.nice(NICE)


def is_better(result: dict, current: str | None) -> tuple[bool, str]:
    """Whether the new adapter should replace the current setting, and the words for it."""
    ratio = math.exp(result["heldout_loss"] - result["heldout_loss_base"])
    words = f"held-out perplexity {ratio:.3f}x the base model's ({(1 - ratio) * 100:+.1f}% better)"
    if not result["heldout_loss"] < result["heldout_loss_base"]:
        return False, f"the tuned adapter is not better than the base model on the held-out files ({words})"
    if current and Path(current).is_file() and Path(current).resolve() != Path(result["adapter"]).resolve():
        try:
            old, new = adapters.read_meta(current), adapters.read_meta(result["adapter"])
        except A3BError:
            old, new = {}, {}
        same = old.get(adapters.SPLIT) and old.get(adapters.SPLIT) == new.get(adapters.SPLIT)
        if same and old.get(adapters.HELDOUT) is not None and old[adapters.HELDOUT] <= result["heldout_loss"]:
            return False, f"the adapter in use is better on the same held-out files; kept it ({words})"
    return True, words


async def tune_workspace(server, session, *args: Any) -> dict:
    folder = args[0] if args and isinstance(args[0], str) else None
    options = args[1] if len(args) > 1 and isinstance(args[1], dict) else {}
    if folder is None:
        roots = server._workspace_roots()
        if not roots:
            raise InvalidRequest("a3b.tuneWorkspace needs a workspace folder (open one, or pass its path).")
        folder = roots[0]
    root = Path(folder).expanduser().resolve()
    options = dict(options)
    model = str(options.pop("model", None) or session.spec().path)
    out = adapter_path(root, Path(model))
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = command_line(root, model, out, options)
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE,
                                                preexec_fn=_lower_priority if hasattr(os, "nice") else None)
    progress = server.supports("window.work_done_progress")
    token = f"a3b-tune-{id(proc)}"
    if progress:
        server.work_done_progress.create(token)
        server.work_done_progress.begin(token, T.WorkDoneProgressBegin(
            title="A3B: tuning", message=f"{root.name}: collecting files", cancellable=False, percentage=0))
    tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)

    async def read_stderr():
        async for line in proc.stderr:
            tail.append(line.decode("utf-8", "replace").rstrip()[:500])
    err_task = asyncio.ensure_future(read_stderr())
    result, last = None, 0.0
    loop = asyncio.get_running_loop()
    try:
        async for raw in proc.stdout:
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(ev, dict):
                continue
            if "result" in ev:
                result = ev["result"]
            elif progress and (loop.time() - last >= REPORT_EVERY or "heldout" in ev):
                last = loop.time()
                steps = max(int(ev.get("steps") or 1), 1)
                msg = (f"step {ev.get('step')}/{steps}, held-out loss {ev['heldout']:.3f}" if "heldout" in ev
                       else f"step {ev.get('step')}/{steps}, loss {ev.get('loss', math.nan):.3f}, "
                            f"{ev.get('tokens_per_s', 0):.0f} tokens/s")
                server.work_done_progress.report(token, T.WorkDoneProgressReport(
                    message=msg, percentage=min(100, int(100 * int(ev.get("step") or 0) / steps))))
        rc = await proc.wait()
        await err_task
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        with contextlib.suppress(asyncio.TimeoutError, ProcessLookupError):
            await asyncio.wait_for(proc.wait(), 5)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        if progress:
            server.work_done_progress.end(token, T.WorkDoneProgressEnd(message="cancelled"))
        raise
    if result is None:
        why = next((ln for ln in reversed(tail) if ln.startswith("a3b: error:")), tail[-1] if tail else "")
        if progress:
            server.work_done_progress.end(token, T.WorkDoneProgressEnd(message="failed"))
        raise TuneFailed(f"a3b tune stopped (status {rc}): {why or 'no message'}")
    use, words = is_better(result, session.settings.lora)
    if use:
        errors = session.configure({"lora": result["adapter"]})
        if errors:
            use, words = False, "; ".join(errors)
    text = f"A3B: tuned on {root.name}: " + (f"the new adapter is in use, {words}." if use else words + ".")
    if progress:
        server.work_done_progress.end(token, T.WorkDoneProgressEnd(message=text))
    server.show(T.MessageType.Info, text)
    return {**result, "used": use, "message": text}
