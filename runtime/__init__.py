"""comfyui-a3b's runtime: one process-wide holder of local GGUF models, served to many callers.

Imports neither the ComfyUI nodes nor the language server, nor ComfyUI or pygls.

One runtime per process, also under two module names
----------------------------------------------------
ComfyUI imports a custom-node pack under a name derived from its folder path, while the language
server and the CLI import the installed package `comfyui_a3b`. The same files then load twice, and
two copies of this package would mean two model stores and two copies of the weights. So the first
copy to load registers itself under a fixed key in `sys.modules`; a later copy makes its own name
(and every already-loaded submodule name) point at the first one. Python's import system returns
whatever `sys.modules` holds for a name after the module body ran, so `import X.runtime` yields the
first copy, classes and exceptions included.
"""
import sys as _sys

_CANONICAL_KEY = "_comfyui_a3b_runtime"
_canonical = _sys.modules.get(_CANONICAL_KEY)

if _canonical is not None and _canonical.__name__ != __name__:
    _prefix = _canonical.__name__
    for _name, _mod in list(_sys.modules.items()):
        if _name.startswith(_prefix + "."):
            _sys.modules[__name__ + _name[len(_prefix):]] = _mod
    _sys.modules[__name__] = _canonical
else:
    _sys.modules[_CANONICAL_KEY] = _sys.modules[__name__]

    from . import chat, errors, gguf_info, llama_engine, locate, serving, store  # noqa: F401  (eager: see above)
    from .core import Runtime, get_runtime
    from .errors import *  # noqa: F401,F403
    from .generation import (PRESETS, PRIORITY_BATCH, PRIORITY_INTERACTIVE, ConfidenceConfig,
                             GenerationRequest, GenerationResult, GenerationStream, LowConfidenceSpan,
                             SamplingParams, TokenEvent, preset)
    from .gguf_info import GGUFInfo, inspect_gguf, sha256_file, verify_sha256
    from .locate import add_model_dir, default_model_path, list_models, resolve_model
    from .store import LoadSpec

    __all__ = [
        "ConfidenceConfig", "GGUFInfo", "GenerationRequest", "GenerationResult", "GenerationStream",
        "LoadSpec", "LowConfidenceSpan", "PRESETS", "PRIORITY_BATCH", "PRIORITY_INTERACTIVE", "Runtime",
        "SamplingParams", "TokenEvent", "add_model_dir", "default_model_path", "get_runtime",
        "inspect_gguf", "list_models", "preset", "resolve_model", "sha256_file", "verify_sha256",
    ]
