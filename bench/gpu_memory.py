"""bench_gpu's GPU memory part: generation, embeddings and editors over one model, and the seconds
an unload takes to give the memory back."""
from __future__ import annotations

import time
from pathlib import Path

from collections.abc import Callable


def gpu_free() -> int:
    from comfyui_a3b.runtime.llama.devices import gpus

    found = gpus()
    return found[0].free_bytes if found else 0


def memory_rows(path: Path, gpu_layers: Callable[[], int], prompt: Callable[..., list[int]]) -> dict:
    from comfyui_a3b.runtime import Runtime

    rt = Runtime()
    base = gpu_free()
    spec = rt.spec(str(path), n_gpu_layers=gpu_layers())   # A3BLoader's defaults
    rt.generate(prompt_tokens=prompt(8), model=spec, max_tokens=2, chat=False)
    one = base - gpu_free()
    rt.embed(["w301 w302 w303", "w304"], model=spec)
    with_embed = base - gpu_free()
    # the language server at its default settings asks for the loader's default context: it shares
    # the workflow's context (its requests take a free sequence there)
    editor = rt.spec(str(path), n_gpu_layers=gpu_layers())
    rt.generate(prompt_tokens=prompt(8), model=editor, max_tokens=2, chat=False)
    with_editor = base - gpu_free()
    # an editor configured with its own nCtx gets a context of its own
    own = rt.spec(str(path), n_gpu_layers=gpu_layers(), n_ctx=4096, n_parallel=1)
    rt.generate(prompt_tokens=prompt(8), model=own, max_tokens=2, chat=False)
    with_own_editor = base - gpu_free()
    auto = rt.spec(str(path))            # n_gpu_layers="auto"
    t0 = time.perf_counter()
    n = rt.unload()
    deadline = time.time() + 60
    while gpu_free() < base - (64 << 20) and time.time() < deadline:
        time.sleep(0.01)
    unload_s = time.perf_counter() - t0
    m = rt.load(auto)
    chosen = m.info.offload
    rt.unload()
    return {"gen_bytes": one, "gen_embed_bytes": with_embed, "gen_embed_editor_bytes": with_editor,
            "ratio_embed": with_embed / one if one else None, "ratio_editor": with_editor / one if one else None,
            "gen_embed_editor_own_ctx_bytes": with_own_editor,
            "ratio_editor_own_ctx": with_own_editor / one if one else None,
            "unload_s": unload_s, "contexts_unloaded": n, "auto_choice": chosen}
