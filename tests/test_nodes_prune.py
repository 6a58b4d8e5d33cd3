"""The loader and prune nodes' pruning without ComfyUI: pruned variants made once and served, their
settings checked with the pruning declarations' bounds, recovery's default for where it runs."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from comfyui_a3b.nodes import core, defs
from comfyui_a3b.runtime import add_model_dir

from node_helpers import generate, loader_args, node


def test_keep_ratio_errors(monkeypatch):
    with pytest.raises(core.NodeError, match="keep_ratio"):
        core.load_model(core.DEFAULT_CHOICE, keep_ratio=1.5)
    from comfyui_a3b import prune

    monkeypatch.delattr(prune, "cached_variant", raising=False)
    with pytest.raises(core.NodeError, match="keep_ratio to 1.0"):
        core.load_model(core.DEFAULT_CHOICE, keep_ratio=0.5)


def _prune(loaded, **settings):
    """A3B Prune over A3B Loader's handle, as a workflow chains them."""
    defaults = {k: v for k, v in defs.PRUNE.defaults().items() if k != "model"}
    return node("A3BPrune").run(unique_id="2", model=loaded, **{**defaults, **settings})["result"][0]


@pytest.mark.slow
def test_keep_ratio_makes_a_pruned_variant_once(rt, tmp_path, monkeypatch, tiny_models):
    """A3B Prune with keep_ratio < 1 loads the pruned copy (made once, cached on disk); without torch,
    a clear error."""
    import importlib.util

    monkeypatch.setenv("A3B_CACHE", str(tmp_path / "cache"))
    add_model_dir(tiny_models["llama"].parent)
    loaded = node("A3BLoader").run(unique_id="1", **{**defs.LOADER.defaults(), "model": tiny_models["llama"].name,
                                                      "n_ctx": 256})["result"][0]
    args = {"keep_ratio": 0.5, "prune_method": "magnitude", "recover_steps": 0}
    if importlib.util.find_spec("torch") is None:
        with pytest.raises(Exception, match="(?i)torch") as ei:
            _prune(loaded, **args)
        assert "pip install" in str(ei.value)
        return
    h = _prune(loaded, **args)
    assert "keep0.5" in os.path.basename(h.path) and str(tmp_path / "cache") in h.path and h.n_ctx == 256
    assert rt.store.entry(h) is not None
    assert isinstance(generate(h, "Say hi.", max_new_tokens=4)["result"][0], str)
    t0 = time.perf_counter()
    assert _prune(loaded, **args) == h  # no second pruning
    assert time.perf_counter() - t0 < 1.0
    rt.unload(h)


@pytest.mark.slow
def test_heads_keep_serves_a_head_pruned_variant(rt, tmp_path, monkeypatch, tiny_models):
    """heads_keep < 1 alone (keep_ratio 1.0) still makes a pruned copy: fewer query heads, same KV heads."""
    pytest.importorskip("torch", reason="the prune extra (torch) is not installed")
    from comfyui_a3b.runtime import inspect_gguf

    monkeypatch.setenv("A3B_CACHE", str(tmp_path / "cache"))
    add_model_dir(tiny_models["llama"].parent)
    base = {**defs.LOADER.defaults(), "n_ctx": 256}
    loaded = node("A3BLoader").run(unique_id="1", **{**base, "model": tiny_models["llama"].name})["result"][0]
    args = {"heads_keep": 0.5, "recover_steps": 0}
    h = _prune(loaded, **args)
    a = inspect_gguf(h.path).a3b
    assert (a["a3b.n_head"], a["a3b.n_head_source"], a["a3b.n_ff"], a["a3b.n_ff_source"]) == (2, 4, 128, 128)
    assert isinstance(generate(h, "Say hi.", max_new_tokens=4)["result"][0], str)
    rt.unload(h)
    qwen2 = node("A3BLoader").run(unique_id="1", **{**base, "model": tiny_models["qwen2"].name})["result"][0]
    for model, bad, match in ((loaded, dict(heads_keep=0.0), "heads_keep must be in"),
                              (loaded, dict(keep_ratio=1.5), "keep_ratio must be in"),
                              (qwen2, dict(heads_keep=0.5), "qwen2")):
        with pytest.raises(Exception, match=match):
            _prune(model, **{**args, **bad})


def test_loader_recover_steps_default_means_the_default_for_where_recovery_runs(tmp_path, monkeypatch):
    """-1 (the widget's default) reaches cached_variant as "unset" (None), which takes the CPU's or the
    GPU's recovery setting (prune.config.with_device_defaults); a number the user sets passes as is."""
    from tinygguf import write_tiny_gguf

    from comfyui_a3b import prune

    assert defs.PRUNE.defaults()["recover_steps"] == -1
    seen = []
    monkeypatch.setattr(prune, "cached_variant", lambda path, **kw: seen.append(kw) or tmp_path / f"v{len(seen)}")
    core.VARIANTS.reset()
    src = write_tiny_gguf(tmp_path / "m.gguf", "llama")   # dense: read to tell it from a mixture of experts
    core.pruned_variant(src, 0.5, None, -1)
    core.pruned_variant(src, 0.5, None, 40)
    core.pruned_variant(src, 1.0, None, -1, 1.0, 0.5)   # expert pruning is one-shot
    assert [kw["recover_steps"] for kw in seen] == [None, 40, 0]


def test_the_prune_node_serves_the_pruned_copy_with_the_loaders_settings(rt, tmp_path, monkeypatch, default_path):
    """A3B Prune: model in, pruned model out (the cached copy, loaded with the loader's settings; the
    source unloaded meanwhile), the input unchanged when every ratio is 1.0; bad ratios refused by name."""
    from comfyui_a3b import prune

    copy = tmp_path / "pruned.gguf"
    shutil.copy(default_path, copy)
    seen = []
    monkeypatch.setattr(prune, "cached_variant", lambda path, **kw: seen.append(kw) or copy)
    core.VARIANTS.reset()
    src = node("A3BLoader").run(unique_id="1", **loader_args(n_ctx=1024, n_gpu_layers=0))["result"][0]
    args = {**defs.PRUNE.defaults(), "model": src}
    assert node("A3BPrune").run(unique_id="2", **args)["result"][0] is src   # 1.0 everywhere: nothing to do
    out = node("A3BPrune").run(unique_id="2", **{**args, "keep_ratio": 0.5})
    pruned = out["result"][0]
    assert pruned.path == str(copy) and pruned.n_ctx == 1024 and pruned.n_gpu_layers == 0
    assert seen[-1]["keep"] == 0.5 and seen[-1]["recover_steps"] is None
    assert rt.loaded(pruned) is not None and rt.loaded(src) is None
    assert "pruned.gguf, n_ctx 1024" in out["ui"]["text"][0]
    assert generate(pruned, "Hi", max_new_tokens=2)["result"][0] is not None
    with pytest.raises(core.NodeError, match="heads_keep"):
        node("A3BPrune").run(unique_id="2", **{**args, "heads_keep": 1.5})
    with pytest.raises(core.NodeError, match="A3BLoader"):
        node("A3BPrune").run(unique_id="2", **{**args, "model": "not a handle"})
