"""Our GPU models inside ComfyUI's model management, so the LLM and the diffusion models share the card.

ComfyUI keeps its loaded models in `comfy.model_management.current_loaded_models` and, before it
loads one (`load_models_gpu`), calls `free_memory(needed, device)`, which walks that list and asks
models to unload (`model_unload`) until enough VRAM is free; "Unload models" (`unload_all_models`)
does the same for everything. A model that is not in the list is invisible to it: ComfyUI would
then run out of memory beside our LLM instead of asking it to make room.

So every model of ours that has layers on the GPU gets an entry in that list: `ManagedLLM`, shaped
like ComfyUI's own `LoadedModel` (the methods and attributes `free_memory`, `load_models_gpu` and
`cleanup_models` use). What it does when ComfyUI asks for the memory is the policy
(`A3B_VRAM_POLICY`, shown in the A3B sidebar):

* `offload` (default): give the VRAM back. A mixture-of-experts model (or a dense one whose FFN
  tensors can move) that ComfyUI asks for fewer bytes than it holds first moves to a smaller
  placement: it is reloaded with more experts in main memory, every layer still on the GPU, and
  keeps serving (runtime/models/handover.py; ComfyUI's `free_memory` passes the bytes it still lacks).
  Otherwise the model is unloaded, and loads again on its next request, asking ComfyUI first to
  make room (`nodes.core.load_model`) and planning its placement for the memory free then. The
  file stays in the OS page cache, so either reload is quick.
* `resident`: keep it: ComfyUI frees its other models instead (and falls back to its low-VRAM
  modes if that is not enough).
* `unload-after-run`: like `offload`, and every model of ours is also unloaded after each
  workflow, leaving the card to ComfyUI between runs.

Nothing here imports ComfyUI: its modules are looked up in `sys.modules` (comfy.py's `_mod`).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ..runtime import LoadSpec, get_runtime
from ..runtime.models import handover
from ..runtime.environment import VARIABLES, env

log = logging.getLogger("a3b.vram")

ENV = "A3B_VRAM_POLICY"
POLICIES = ("offload", "resident", "unload-after-run")
DEFAULT_POLICY = VARIABLES[ENV].default

_lock = threading.Lock()


class _Registry:
    """Our models in ComfyUI's list, by spec, and whether the store listener is installed."""

    def __init__(self) -> None:
        self.managed: dict[LoadSpec, ManagedLLM] = {}
        self.installed = False

    def reset(self) -> None:
        """As at the start of a process: nothing managed, nothing installed."""
        with _lock:
            self.managed.clear()
            self.installed = False


REGISTRY = _Registry()


def policy() -> str:
    value = env(ENV).strip().lower()
    if value not in POLICIES:
        log.warning("%s=%r is not one of %s; using %s", ENV, value, ", ".join(POLICIES), DEFAULT_POLICY)
        return DEFAULT_POLICY
    return value


class _Handle:
    """What ComfyUI sees as the model: it logs `model.model.__class__.__name__` and counts references."""

    def __init__(self, name: str):
        self.model = self            # ComfyUI reads .model.model
        self.name = name

    def __repr__(self) -> str:
        return f"A3B LLM {self.name}"


class ManagedLLM:
    """One of our GPU models, in ComfyUI's `current_loaded_models`, duck-typed like its LoadedModel."""

    def __init__(self, spec: LoadSpec, device: Any, nbytes: int):
        self.spec = spec
        self.device = device
        self.nbytes = int(nbytes)
        self.currently_used = True
        self.model = _Handle(os.path.basename(spec.path))
        self.model_finalizer = None
        self.unloading = False       # set while ComfyUI itself unloads us (it removes the entry then)
        self.reloading = False       # set while we reload in a smaller placement (the entry stays)
        self.handovers: list[dict] = []   # the smaller placements moved to, for the status
        self._loaded = True

    # -- what free_memory / load_models_gpu / cleanup_models read -----------------------------------
    def real_model(self):
        return self.model if self._loaded else None

    def is_dead(self) -> bool:
        return False

    def model_memory(self) -> int:
        return self.nbytes

    def model_loaded_memory(self) -> int:
        return self.nbytes if self._loaded else 0

    def model_offloaded_memory(self) -> int:
        return 0

    def model_memory_required(self, device) -> int:
        return self.nbytes

    def model_use_more_vram(self, extra_memory, force_patch_weights=False) -> int:
        return 0

    def model_unload(self, memory_to_free=None, unpatch_weights=True) -> bool:
        """ComfyUI needs the VRAM: give it back unless the policy keeps the model resident."""
        if policy() == "resident":
            log.info("a3b: keeping %s on the GPU (%s=resident)", self.model.name, ENV)
            return False
        if memory_to_free is not None and 0 < memory_to_free < self.nbytes and self._smaller(memory_to_free):
            return False
        self.unloading = True
        self._loaded = False
        n = get_runtime().unload(self.spec)
        log.info("a3b: gave %.1f GiB of VRAM back to ComfyUI (%s unloaded, %d context(s)); it reloads on its "
                 "next request", self.nbytes / 2**30, self.model.name, n)
        return True

    def _smaller(self, nbytes: int) -> bool:
        """Give `nbytes` back by a smaller placement, staying loaded and listed; False where there is none."""
        self.reloading = True
        try:
            res = handover.give_back(get_runtime(), self.spec, int(nbytes))
        except Exception:   # the reload failed: unloading (the caller's next step) still frees the memory
            log.exception("a3b: a smaller placement of %s failed; unloading it", self.model.name)
            res = None
        finally:
            self.reloading = False
        if res is None:
            return False
        before = self.nbytes
        self.nbytes = res["gpu_bytes"]
        self.handovers.append({**res, "asked_bytes": int(nbytes), "before_bytes": before})
        log.info("a3b: gave %.1f GiB of VRAM back to ComfyUI by a smaller placement of %s in %.1f s: %s",
                 (before - self.nbytes) / 2**30, self.model.name, res["seconds"], res["offload"])
        return True

    def __eq__(self, other) -> bool:
        return self is other

    __hash__ = object.__hash__


def _listener(event: str, spec: LoadSpec) -> None:
    """Store events: add a loaded GPU model to ComfyUI's list, take an unloaded one out."""
    mm = _mm()
    if mm is None:
        return
    rt = get_runtime()
    with _lock:
        current = REGISTRY.managed.get(spec)
        if current is not None and current.reloading:
            return   # a smaller placement of a listed model: its entry stays where ComfyUI has it
        if event == "loaded":
            m = rt.loaded(spec)
            if m is None or m.info.n_gpu_layers == 0 or spec in REGISTRY.managed:
                return
            entry = ManagedLLM(spec, mm.get_torch_device(), _gpu_bytes(rt, spec, m))
            REGISTRY.managed[spec] = entry
            mm.current_loaded_models.insert(0, entry)
        elif event == "unloaded":
            entry = REGISTRY.managed.pop(spec, None)
            if entry is not None and not entry.unloading:
                entry._loaded = False
                try:
                    mm.current_loaded_models.remove(entry)
                except ValueError:
                    pass


def _gpu_bytes(rt, spec: LoadSpec, m) -> int:
    """The device memory the model holds: measured after its load where the engine says, else planned,
    else the whole model's estimate scaled by its share of layers on the GPU."""
    placed = m.info.placement or {}
    held = placed.get("measured", {}).get("gpu_bytes") or placed.get("gpu_bytes")
    if held:
        return int(held)
    total = rt.estimate_gpu_bytes(spec)
    n_layer = max(m.info.n_layer, 1)
    share = min(m.info.n_gpu_layers if m.info.n_gpu_layers >= 0 else n_layer + 1, n_layer + 1) / (n_layer + 1)
    return int(total * share)


def _mm():
    from .comfy import _mod

    return _mod("comfy.model_management")


def install() -> bool:
    """Take part in ComfyUI's model management (once); False outside ComfyUI."""
    if _mm() is None:
        return False
    with _lock:
        if REGISTRY.installed:
            return True
        REGISTRY.installed = True
    get_runtime().store.add_listener(_listener)
    _hook_run_end()
    if _gpu_shared():
        log.info("a3b: our GPU models take part in ComfyUI's model management (%s=%s)", ENV, policy())
    return True


def _gpu_shared() -> bool:
    """Whether there is a card to share: ComfyUI not started with --cpu, and llama.cpp seeing a GPU.
    Without one, nothing here ever acts, and a line about GPU models would only mislead."""
    mm = _mm()
    cpu = getattr(getattr(mm, "CPUState", None), "CPU", None)
    if cpu is not None and getattr(mm, "cpu_state", None) == cpu:
        return False
    try:
        return get_runtime().gpu_available()
    except Exception:  # noqa: BLE001 - llama-cpp-python missing or broken: the pack reports that itself
        return False


def _hook_run_end() -> None:
    """With `unload-after-run`, unload our models once each workflow has run."""
    from .comfy import _mod

    execution = _mod("execution")
    executor = getattr(execution, "PromptExecutor", None) if execution is not None else None
    if executor is None or getattr(executor.execute, "_a3b_hooked", False):
        return
    original = executor.execute

    def execute(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            if policy() == "unload-after-run":
                n = get_runtime().unload()
                if n:
                    log.info("a3b: unloaded %d model context(s) after the workflow (%s=unload-after-run)", n, ENV)

    execute._a3b_hooked = True  # type: ignore[attr-defined]
    executor.execute = execute


def status() -> dict:
    with _lock:
        return {"policy": policy(), "managed": [{"model": e.model.name, "bytes": e.nbytes, "loaded": e._loaded,
                                                 "handovers": e.handovers[-3:]}
                                                for e in REGISTRY.managed.values()]}
