"""comfyui-a3b: ComfyUI entry point.

The repository root is both the ComfyUI custom-node folder and, when pip-installed, the package
`comfyui_a3b`. Importing it never imports ComfyUI at module level and never installs anything, so the
language server and the CLI import the same package outside ComfyUI.
"""
from . import runtime  # noqa: F401  (registers the process-wide runtime first)

WEB_DIRECTORY = "./web"
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
