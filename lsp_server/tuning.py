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

An editor reads and writes only where the user put things: `options.model` must name a model in the
model folders (as the `model` setting), `options.out` a .gguf path in the adapters' cache folder or a
LoRA folder, and every other option must be one of `a3b tune`'s training options (its parser takes
an unambiguous prefix of any flag, so `{"o": ...}` would be `--out`): anything else is refused.
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

from ..runtime.models import adapters
from ..runtime.errors import A3BError, InvalidRequest
from ..runtime.models.locate import adapter_cache_dir

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
    return adapter_cache_dir() / f"{root.name or 'workspace'}-{tag}.{model.stem}.lora.gguf"


def _flag(key: str) -> str:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{0,40}", key):
        raise InvalidRequest(f"a3b.tuneWorkspace: {key!r} is not an option name.")
    flag = "--" + re.sub(r"(?<!^)([A-Z])", r"-\1", key).lower()
    known = _known_flags()
    if flag not in known:
        names = sorted(re.sub(r"-(\w)", lambda m: m.group(1).upper(), f[2:]) for f in known)
        raise InvalidRequest(f"a3b.tuneWorkspace: unknown option {key!r} (options: model, out, {', '.join(names)}).")
    return flag


def _known_flags() -> set[str]:
    """`a3b tune`'s training flags (tune/options.py) and --restart: what an editor may pass."""
    from ..tune.options import OPTIONS

    return {"--" + o.name.replace("_", "-") for o in OPTIONS} | {"--restart"}


def model_for(value: Any, session) -> str:
    """The base model of a tuning: the editor's model, or one named in the model folders (never a path
    outside them, as for the `model` setting)."""
    if value is None:
        return str(session.spec().path)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"a3b.tuneWorkspace: model must be a model name or path, got {value!r}.")
    from ..runtime.models.locate import resolve_model

    return str(resolve_model(value, restrict=True))


def out_for(value: Any, root: Path, model: Path) -> Path:
    """Where the adapter goes: the cache folder's default for (workspace, model), or a .gguf path
    inside the adapters' cache folder or a LoRA folder; not an existing link or non-file."""
    if value is None:
        return adapter_path(root, model)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"a3b.tuneWorkspace: out must be a path, got {value!r}.")
    from ..runtime.errors import PathNotAllowed
    from ..runtime.models.locate import adapter_cache_dir, inside_any, lora_dirs

    folders = lora_dirs()
    p = Path(value).expanduser()
    p = p if p.is_absolute() else adapter_cache_dir() / p
    if p.is_symlink() or (p.exists() and not p.is_file()):
        raise PathNotAllowed(f"a3b.tuneWorkspace: out {value!r} exists and is a link or not a regular file; "
                             "give the path of a new or an existing adapter file.")
    if not inside_any(p.parent, folders) or not inside_any(p, folders):
        raise PathNotAllowed(f"a3b.tuneWorkspace: out {value!r} is outside the adapters' folders "
                             f"({', '.join(map(str, folders))}); leave it out (the cache folder) or name a file there.")
    if p.suffix.lower() != ".gguf":
        raise InvalidRequest(f"a3b.tuneWorkspace: out {value!r} must be a .gguf file name.")
    return p.parent.resolve() / p.name


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
        roots = server.workspace_roots()
        if not roots:
            raise InvalidRequest("a3b.tuneWorkspace needs a workspace folder (open one, or pass its path).")
        folder = roots[0]
    root = Path(folder).expanduser().resolve()
    options = dict(options)
    model = model_for(options.pop("model", None), session)
    out = out_for(options.pop("out", None), root, Path(model))
    argv = command_line(root, model, out, options)   # the options checked before anything is created
    out.parent.mkdir(parents=True, exist_ok=True)
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
