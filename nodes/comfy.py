"""ComfyUI services the nodes use, each guarded: outside ComfyUI they do nothing.

Nothing here imports ComfyUI at module level. Inside ComfyUI its modules (`folder_paths`,
`comfy.model_management`, `comfy.utils`, `server`) are already loaded when the pack is imported.
"""
from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..runtime import add_model_dir, get_runtime
from ..runtime.models.locate import add_lora_dir
from ..runtime.environment import env_paths

log = logging.getLogger("a3b.comfy")

#: Custom websocket events the web extension listens to.
EVENT_TOKEN = "a3b.token"
EVENT_DONE = "a3b.done"


def inside_comfyui() -> bool:
    """True when this process is a running ComfyUI (its server and model management are loaded)."""
    return "comfy.model_management" in sys.modules and "folder_paths" in sys.modules


def _mod(name: str):
    return sys.modules.get(name) if inside_comfyui() else None


# -- model folders -----------------------------------------------------------------------------------
def register_model_folders() -> list[Path]:
    """Register ComfyUI's models/LLM folder (creating it) with folder_paths and the runtime."""
    fp = _mod("folder_paths")
    if fp is None:
        return []
    default = Path(fp.models_dir) / "LLM"
    try:
        default.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("a3b: cannot create %s: %s", default, e)
    if "LLM" not in fp.folder_names_and_paths:
        fp.folder_names_and_paths["LLM"] = ([str(default)], {".gguf"})
    else:
        paths, exts = fp.folder_names_and_paths["LLM"]
        if str(default) not in paths:
            paths.append(str(default))
        if isinstance(exts, set):
            exts.add(".gguf")
    dirs = [Path(p) for p in fp.get_folder_paths("LLM")]
    for d in dirs:
        add_model_dir(d)
    for d in lora_folders():   # an editor on the in-process language server may name adapters there
        add_lora_dir(d)
    return dirs


def lora_folders() -> list[Path]:
    """Where GGUF LoRA adapters are looked for: models/LLM/loras and ComfyUI's loras folders."""
    fp = _mod("folder_paths")
    out: list[Path] = []
    if fp is not None:
        out += [Path(p) / "loras" for p in fp.get_folder_paths("LLM")]
        try:
            out += [Path(p) for p in fp.get_folder_paths("loras")]
        except Exception:  # noqa: BLE001
            pass
    out += [Path(part) for part in env_paths("A3B_LORAS")]
    return out


# -- while a node runs ----------------------------------------------------------------------------------
def interrupted() -> bool:
    """ComfyUI's Cancel button / POST /interrupt sets this flag; read it without clearing it."""
    mm = _mod("comfy.model_management")
    return bool(mm.processing_interrupted()) if mm is not None else False


def raise_interrupted() -> None:
    """Raise ComfyUI's own InterruptProcessingException (so it reports 'interrupted', not an error)."""
    mm = _mod("comfy.model_management")
    if mm is not None:
        mm.throw_exception_if_processing_interrupted()


def is_interrupt(exc: BaseException) -> bool:
    mm = _mod("comfy.model_management")
    return mm is not None and isinstance(exc, mm.InterruptProcessingException)


def progress_bar(total: int, node_id: str | None) -> Callable[[int], None]:
    utils = _mod("comfy.utils")
    if utils is None:
        return lambda n: None
    bar = utils.ProgressBar(total, node_id=node_id)
    return lambda n: bar.update_absolute(min(n, total), total)


def _server():
    srv = _mod("server")
    return getattr(getattr(srv, "PromptServer", None), "instance", None) if srv is not None else None


def send(event: str, data: dict[str, Any]) -> None:
    """Send a websocket event to the client that queued the running prompt (nothing without one)."""
    srv = _server()
    if srv is None or srv.client_id is None:
        return
    data.setdefault("prompt_id", getattr(srv, "last_prompt_id", None))
    srv.send_sync(event, data, srv.client_id)


def free_vram(nbytes: int) -> None:
    """Ask ComfyUI to move its own models out of VRAM before we put layers on the GPU."""
    mm = _mod("comfy.model_management")
    if mm is None:
        return
    try:
        mm.free_memory(nbytes * 1.2 + mm.minimum_inference_memory(), mm.get_torch_device())
    except Exception as e:  # noqa: BLE001  (best effort: the load itself reports real failures)
        log.warning("a3b: ComfyUI could not free VRAM: %s", e)


def inference_reserve() -> int:
    """Device memory ComfyUI's model management keeps for its own inference beyond the models it holds
    (its minimum inference memory and extra reserve): what our planner leaves free inside ComfyUI."""
    mm = _mod("comfy.model_management")
    if mm is None:
        return 0
    try:
        return int(mm.minimum_inference_memory() + getattr(mm, "extra_reserved_memory", lambda: 0)())
    except Exception as e:  # noqa: BLE001  (best effort: then nothing extra is kept free)
        log.warning("a3b: ComfyUI did not say what it keeps free: %s", e)
        return 0


# -- error names ---------------------------------------------------------------------------------------------
#: the name the package has when installed; ComfyUI imports the folder under its path instead
PACKAGE = "comfyui_a3b"


def tidy_error_names() -> int:
    """Give the pack's exception classes their package's name as module, so ComfyUI's error panel (which
    shows `module.Class`) says `comfyui_a3b.runtime.errors.PromptTooLong` rather than the folder path
    ComfyUI imported the pack under. Returns how many classes were renamed."""
    from ..runtime.errors import A3BError

    root = __name__.rsplit(".nodes.", 1)[0]   # the pack's module name in this process
    if root == PACKAGE:
        return 0
    seen, todo, n = set(), [A3BError], 0
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        mod = cls.__module__
        if mod == root or mod.startswith(root + "."):
            cls.__module__ = PACKAGE + mod[len(root):]
            n += 1
    return n


# -- "Unload models" and /free --------------------------------------------------------------------------
_hook_lock = threading.Lock()


def hook_unload_all_models() -> bool:
    """Make ComfyUI's "Unload models" (POST /free) release our models too.

    ComfyUI's prompt worker calls `comfy.model_management.unload_all_models()` when /free asks for
    `unload_models` or `free_memory`; it looks the function up on the module each time, so wrapping
    the module attribute reaches it. The wrapper calls ComfyUI's own function first, then ours.
    """
    mm = _mod("comfy.model_management")
    if mm is None:
        return False
    with _hook_lock:
        current = mm.unload_all_models
        if getattr(current, "_a3b_hooked", False):
            return True

        def unload_all_models(*args, **kwargs):
            try:
                return current(*args, **kwargs)
            finally:
                try:
                    n = get_runtime().unload()
                    if n:
                        log.info("a3b: unloaded %d model context(s) with ComfyUI's models", n)
                except Exception:
                    log.exception("a3b: unloading our models failed")

        unload_all_models._a3b_hooked = True  # type: ignore[attr-defined]
        unload_all_models.__wrapped__ = current  # type: ignore[attr-defined]
        mm.unload_all_models = unload_all_models
    return True


# -- HTTP routes ------------------------------------------------------------------------------------------
def register_routes() -> bool:
    """GET /a3b/status, POST /a3b/unload and GET /a3b/models on ComfyUI's server (also under /api)."""
    srv = _server()
    if srv is None:
        return False
    from aiohttp import web

    from . import core

    routes = srv.routes

    @routes.get("/a3b/status")
    async def a3b_status(request):
        return web.json_response(core.status(), dumps=_dumps)

    @routes.post("/a3b/unload")
    async def a3b_unload(request):
        n = core.unload()
        return web.json_response({"unloaded": n, "status": core.status()}, dumps=_dumps)

    @routes.get("/a3b/models")
    async def a3b_models(request):
        register_model_folders()
        return web.json_response({"models": core.model_choices()})

    return True


def _dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, default=str)
