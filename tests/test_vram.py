"""GPU models in ComfyUI's model management (nodes/vram.py), and the layer planner (runtime/llama/offload.py).

The contract tests use a stand-in for the two ComfyUI modules the pack looks for; the last test runs
ComfyUI's real `comfy.model_management` (its own free_memory and unload_all_models) when
COMFYUI_DIR points at a ComfyUI checkout. No GPU is needed: the fake engine reports GPU layers.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from comfyui_a3b.runtime import get_runtime
from comfyui_a3b.runtime.llama import offload

from tinygguf import write_tiny_gguf

COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
GPU_MODEL = "fake://gpu?gpu_layers=30"


@pytest.fixture
def comfy(monkeypatch, fake_engine):
    """Stand-ins for comfy.model_management, folder_paths and execution, and vram installed over them."""
    from comfyui_a3b.nodes import vram

    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models = []
    mm.get_torch_device = lambda: "cuda:0"
    execution = types.ModuleType("execution")

    class PromptExecutor:
        def execute(self, *args):
            return "ran"

    execution.PromptExecutor = PromptExecutor
    for name, mod in (("comfy.model_management", mm), ("folder_paths", types.ModuleType("folder_paths")),
                      ("execution", execution)):
        monkeypatch.setitem(sys.modules, name, mod)
    vram.REGISTRY.reset()
    assert vram.install()
    yield mm, execution
    get_runtime().unload()
    get_runtime().store.remove_listener(vram._listener)
    vram.REGISTRY.reset()


def test_a_gpu_model_joins_comfyuis_list_and_leaves_it_when_unloaded(comfy):
    mm, _ = comfy
    rt = get_runtime()
    spec = rt.spec(GPU_MODEL)
    rt.load(spec)
    [entry] = mm.current_loaded_models
    assert entry.device == "cuda:0" and entry.model_memory() > 0 and entry.real_model() is not None
    assert not entry.is_dead() and entry.model_offloaded_memory() == 0
    cpu = rt.spec("fake://cpu")
    rt.load(cpu)                                   # a CPU model takes no VRAM: not listed
    assert len(mm.current_loaded_models) == 1
    rt.unload(spec)                                # unloaded by us (A3B Unload, an eviction)
    assert mm.current_loaded_models == [] and entry.real_model() is None


def test_comfyui_asking_for_memory_follows_the_policy(comfy, monkeypatch):
    mm, _ = comfy
    rt = get_runtime()
    spec = rt.spec(GPU_MODEL)
    rt.load(spec)
    [entry] = mm.current_loaded_models
    monkeypatch.setenv("A3B_VRAM_POLICY", "resident")
    assert entry.model_unload(1 << 30) is False and rt.loaded(spec) is not None
    monkeypatch.setenv("A3B_VRAM_POLICY", "offload")
    assert entry.model_unload(1 << 30) is True and rt.loaded(spec) is None
    assert mm.current_loaded_models == [entry]     # ComfyUI removes the entry itself after True
    mm.current_loaded_models.remove(entry)
    rt.load(spec)                                  # the next request loads it again, listed again
    assert len(mm.current_loaded_models) == 1 and mm.current_loaded_models[0] is not entry
    monkeypatch.setenv("A3B_VRAM_POLICY", "sometimes")
    from comfyui_a3b.nodes import vram

    assert vram.policy() == "offload"              # an unknown policy falls back, with a warning


def test_unload_after_run_frees_our_models_when_a_workflow_ends(comfy, monkeypatch):
    _, execution = comfy
    rt = get_runtime()
    rt.load(rt.spec(GPU_MODEL))
    assert execution.PromptExecutor().execute("prompt") == "ran"
    assert rt.loaded(rt.spec(GPU_MODEL)) is not None          # offload: kept between workflows
    monkeypatch.setenv("A3B_VRAM_POLICY", "unload-after-run")
    assert execution.PromptExecutor().execute("prompt") == "ran"
    assert rt.store.loaded() == []


def test_the_planner_offloads_what_fits_from_the_top_layer_down(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", n_layer=4)
    layers, output, _ = offload.model_sizes(path)
    assert len(layers) == 4 and all(x > 0 for x in layers) and output > 0
    args = dict(n_ctx=256, n_parallel=1, n_batch=64, kv_cache_type="f16")
    full = offload.plan(path, free_bytes=8 << 30, **args)
    assert full.n_gpu_layers == 5 and "whole model" in full.reason         # every layer and the output
    dims = offload.model_sizes(path)[2]
    kv = offload.kv_bytes_per_layer(dims, 256, "f16")
    assert dims.n_vocab == 271                  # the logits reserve follows the file's vocabulary
    reserve = offload.FIXED_RESERVE + 2 * 64 * dims.n_vocab * 4
    two = offload.plan(path, free_bytes=reserve + 2 * (layers[-1] + kv) + 10, **args)
    assert two.n_gpu_layers == 2 and "2/4 layers" in two.describe()
    none = offload.plan(path, free_bytes=reserve // 2, **args)
    assert none.n_gpu_layers == 0 and "not even one layer" in none.reason


@pytest.mark.slow
@pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout")
def test_comfyuis_own_model_management_unloads_our_model(tmp_path):
    """ComfyUI's real free_memory and unload_all_models walk their list and reach our entry."""
    tests = Path(__file__).resolve().parent
    code = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = [{COMFYUI_DIR!r}, {str(tests)!r}]
        sys.argv = ["main.py", "--cpu"]
        import comfy.options; comfy.options.enable_args_parsing()
        import comfy.model_management as mm, folder_paths
        import fakeengine; fakeengine.install()
        from comfyui_a3b.nodes import vram
        from comfyui_a3b.runtime import get_runtime
        assert vram.install()
        rt = get_runtime()
        for policy in ("resident", "offload"):
            os.environ["A3B_VRAM_POLICY"] = policy
            spec = rt.spec("fake://gpu?gpu_layers=30")
            rt.load(spec)
            before = len(mm.current_loaded_models)
            mm.free_memory(1e30, mm.get_torch_device())
            print(policy, before, len(mm.current_loaded_models), rt.loaded(spec) is not None)
        rt.load(spec)
        mm.unload_all_models()
        print("unload_all", len(mm.current_loaded_models), len(rt.store.loaded()))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "A3B_CACHE": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.split("\n")
    assert "resident 1 1 True" in lines and "offload 1 0 False" in lines and "unload_all 0 0" in lines, p.stdout


def test_more_gpu_layers_than_the_model_has_are_clamped_and_said():
    assert offload.clamp_layers(99, 36) == (37, "n_gpu_layers=99 is more than the model's 36 layers + output: "
                                                "all 36 layers and the output on the GPU")
    assert offload.clamp_layers(37, 36) == (37, None) and offload.clamp_layers(10, 36) == (10, None)


def test_a_model_larger_than_the_machines_memory_is_refused_before_loading(tmp_path, monkeypatch):
    from comfyui_a3b.runtime import ModelLoadFailed, Runtime

    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", n_layer=4)
    args = dict(n_ctx=256, n_parallel=1, kv_cache_type="f16")
    cpu = offload.host_bytes(path, n_gpu_layers=0, **args)
    layers, output, _ = offload.model_sizes(path)
    assert cpu > sum(layers) + output                                   # weights and KV cache
    assert offload.host_bytes(path, n_gpu_layers=-1, **args) == 0       # all on the GPU: nothing on the CPU
    assert offload.host_bytes(path, n_gpu_layers=2, **args) < cpu
    from comfyui_a3b.runtime.llama import fitting, placement, planner

    cpu = planner.cost(placement.layout(path), n_gpu_layers=0, n_cpu_moe=0, n_ctx=256, n_parallel=1, n_batch=256,
                       gpu=False)["host"]       # what the loader checks: token_embd included
    monkeypatch.setattr(fitting, "total_memory", lambda: cpu - 1)
    rt = Runtime()
    with pytest.raises(ModelLoadFailed, match=r"main memory .* more than this machine's"):
        rt.load(str(path), n_gpu_layers=0, n_ctx=256, n_parallel=1)
    assert rt.store.loaded() == []
    monkeypatch.setattr(fitting, "total_memory", lambda: cpu + 1)
    rt.load(str(path), n_gpu_layers=0, n_ctx=256, n_parallel=1)
    rt.unload()


@pytest.mark.parametrize("comfyui_cpu,llama_gpu,said",
                         [(True, True, False), (False, False, False), (False, True, True)],
                         ids=["comfyui --cpu", "no GPU for llama.cpp", "a card to share"])
def test_the_gpu_models_line_only_where_there_is_a_card_to_share(monkeypatch, caplog, fake_engine, comfyui_cpu,
                                                                 llama_gpu, said):
    import enum
    import logging

    from comfyui_a3b.nodes import vram
    from comfyui_a3b.runtime.core import Runtime

    class CPUState(enum.Enum):   # as comfy.model_management declares it
        GPU, CPU, MPS = 0, 1, 2

    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models = []
    mm.CPUState, mm.cpu_state = CPUState, CPUState.CPU if comfyui_cpu else CPUState.GPU
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setitem(sys.modules, "folder_paths", types.ModuleType("folder_paths"))
    monkeypatch.setattr(Runtime, "gpu_available", lambda self, model=None: llama_gpu)
    vram.REGISTRY.reset()
    try:
        with caplog.at_level(logging.INFO, logger="a3b.vram"):
            assert vram.install()
    finally:
        get_runtime().store.remove_listener(vram._listener)
        vram.REGISTRY.reset()
    assert any("GPU models" in r.getMessage() for r in caplog.records) == said, caplog.text
