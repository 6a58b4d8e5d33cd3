"""comfyui-a3b: ComfyUI entry point.

The repository root is both the ComfyUI custom-node folder and, when pip-installed, the package
`comfyui_a3b`. Importing it never imports ComfyUI at module level and never installs anything, so the
language server and the CLI import the same package outside ComfyUI.

Inside ComfyUI (its modules are already loaded when it imports custom nodes) the pack offers V3
nodes through `comfy_entrypoint` when the running ComfyUI has the V3 API, V1 mappings otherwise,
registers models/LLM, its HTTP routes and the "Unload models" hook, and may start the in-process
language server and the OpenAI-compatible server (`A3B_LSP`, `A3B_SERVE`).
"""
import logging as _logging
import sys as _sys

from . import runtime  # first: registers the process-wide runtime (see runtime/__init__.py)

WEB_DIRECTORY = "./web"
NODE_CLASS_MAPPINGS = None
NODE_DISPLAY_NAME_MAPPINGS = None

_log = _logging.getLogger("a3b")


def _inside_comfyui() -> bool:
    return "comfy.model_management" in _sys.modules and "folder_paths" in _sys.modules


def _check_llama_cpp() -> None:
    """One clear log line when llama-cpp-python is missing or broken (nodes then say how to fix it)."""
    from .runtime.errors import LlamaCppUnavailable
    from .runtime.llama import check_usable

    try:
        check_usable()
    except LlamaCppUnavailable as e:
        _log.error("[comfyui-a3b] %s", e)


def _start_language_server() -> None:
    """Start the in-process language server if it is enabled (off by default); never fail the pack."""
    try:
        from .lsp_server import inprocess

        info = inprocess.maybe_start()
        if info:
            _log.info("[comfyui-a3b] language server listening on %s", info.get("address"))
    except Exception as e:  # noqa: BLE001  (a missing or broken optional part must not stop the nodes)
        _log.warning("[comfyui-a3b] in-process language server not started: %s: %s", type(e).__name__, e)


def _start_http_server() -> None:
    """Start `a3b serve` inside ComfyUI if $A3B_SERVE asks for it (off by default); never fail the pack."""
    try:
        from .serve import inprocess

        info = inprocess.maybe_start()
        if info:
            _log.info("[comfyui-a3b] OpenAI-compatible server listening: %s", info["url"])
    except Exception as e:  # noqa: BLE001  (a missing or broken optional part must not stop the nodes)
        _log.warning("[comfyui-a3b] in-process OpenAI-compatible server not started: %s: %s", type(e).__name__, e)


def _setup_comfyui() -> None:
    from .nodes import comfy

    comfy.register_model_folders()
    comfy.hook_unload_all_models()
    comfy.tidy_error_names()
    try:
        from .nodes import vram

        vram.install()
        runtime.get_runtime().status_providers["vram"] = vram.status
    except Exception as e:  # noqa: BLE001 - an optional part must not stop the nodes
        _log.warning("[comfyui-a3b] VRAM sharing with ComfyUI not set up: %s: %s", type(e).__name__, e)
    try:
        comfy.register_routes()
    except Exception as e:  # noqa: BLE001
        _log.warning("[comfyui-a3b] HTTP routes not registered: %s", e)
    _check_llama_cpp()
    _start_language_server()
    _start_http_server()


if _inside_comfyui():
    _setup_comfyui()
    if "comfy_api.latest" in _sys.modules:
        from .nodes.v3 import comfy_entrypoint  # noqa: F401
    else:
        from .nodes.v1 import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
else:
    from .nodes.v1 import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
