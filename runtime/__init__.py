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

    # first: llama.cpp's libraries, loaded before the C++ runtime where nothing loaded it yet
    # (see llama/cxxruntime.py)
    from . import llama  # noqa: F401

    from . import chat, engine, errors, fim, generation, options, remote, requests  # noqa: F401  (eager: see above)
    from .local import scheduler, worker  # noqa: F401
    from .models import gguf_info, ggufscan, locate, store, vet  # noqa: F401

    from .llama import local_engine

    engine.set_default_engine(local_engine.ENGINE)   # model files run in this process; URLs: see remote/
    from .core import Runtime, get_runtime
    from .engine import Engine, Model, ModelInfo, register_engine, unregister_engine
    from .errors import (A3BError, Cancelled, ChecksumMismatch, ContextTooLarge, CorruptGGUF, EmbeddingsUnsupported,
                         InvalidImage, InvalidRequest, LlamaCppUnavailable, ModelLoadFailed, ModelNotFound,
                         ModelUnloaded, NotGGUF, PathNotAllowed, PromptTooLong, RemoteAuthFailed, RemoteError,
                         RemoteProtocolError, RemoteUnreachable, TruncatedGGUF, UnsupportedArchitecture,
                         VisionUnavailable)
    from .generation import (PRESETS, ConfidenceConfig, GenerationResult, LowConfidenceSpan,
                             SamplingParams, TokenEvent, preset)
    from .stream import GenerationStream
    from .models.gguf_info import GGUFInfo, inspect_gguf, sha256_file, verify_sha256
    from .models.locate import add_model_dir, default_model_path, list_models, resolve_model
    from .options import LoadSpec
    from .requests import (ChatPrompt, ContextChunk, GenerationRequest, ImagePart, InfillPrompt, Prompt, TextPrompt,
                           TokenPrompt)
    from .generation import PRIORITY_BATCH, PRIORITY_INTERACTIVE
    from .local.worker import LoadedModel

    __all__ = [
        "A3BError", "Cancelled", "ChatPrompt", "ChecksumMismatch", "ConfidenceConfig", "ContextChunk",
        "ContextTooLarge", "CorruptGGUF", "EmbeddingsUnsupported", "Engine", "GGUFInfo", "GenerationRequest",
        "GenerationResult", "GenerationStream", "ImagePart", "InfillPrompt", "InvalidImage", "InvalidRequest",
        "LlamaCppUnavailable", "LoadSpec",
        "LoadedModel", "LowConfidenceSpan", "Model", "ModelInfo", "ModelLoadFailed", "ModelNotFound",
        "ModelUnloaded", "NotGGUF", "PRESETS", "Prompt", "TextPrompt", "TokenPrompt",
        "PRIORITY_BATCH", "PRIORITY_INTERACTIVE", "PathNotAllowed", "PromptTooLong", "RemoteAuthFailed",
        "RemoteError", "RemoteProtocolError", "RemoteUnreachable", "Runtime",
        "SamplingParams", "TokenEvent", "TruncatedGGUF", "UnsupportedArchitecture", "VisionUnavailable",
        "add_model_dir",
        "default_model_path", "get_runtime", "inspect_gguf", "list_models", "preset", "register_engine",
        "resolve_model", "sha256_file", "unregister_engine", "verify_sha256",
    ]
