"""Tensor placement: the planner's choices from GGUF metadata with fake free-memory figures, the
placement options' bad inputs, the store key, ComfyUI's hand-over by a smaller placement, and (slow)
a tiny qwen3moe loaded with its experts on the CPU buffer type giving the default placement's logits.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from comfyui_a3b.runtime import InvalidRequest, LoadSpec, get_runtime
from comfyui_a3b.runtime.models import handover
from comfyui_a3b.runtime.llama import placement, planner
from comfyui_a3b.runtime.llama.devices import Device

from tinygguf import write_tiny_gguf

ARGS = dict(n_ctx=256, n_parallel=1, n_batch=64)
GPU = Device(0, "CUDA0", "fake card", "gpu", 0, 0)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("p") / "moe.gguf", "qwen3moe", n_layer=4, n_expert=8, seed=1)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("p") / "dense.gguf", "qwen3", n_layer=4, seed=2)


def gpu_cost(lay, k, n, **kw):
    return planner.cost(lay, n_gpu_layers=k, n_cpu_moe=n, **{**ARGS, **kw})["gpu"]


def free_for(lay, k, n, **kw):
    """The free memory in which exactly this placement fits."""
    return planner.MARGIN + gpu_cost(lay, k, n, **kw)


def test_the_planner_moves_experts_layer_by_layer_before_whole_layers(moe):
    lay = placement.layout(moe)
    assert lay.moe and lay.n_layer == 4
    assert {t.name for t in lay.tensors if t.movable} == {f"blk.{i}.ffn_{w}_exps.weight" for i in range(4)
                                                          for w in ("gate", "up", "down")}
    full = planner.plan(lay, free_bytes=free_for(lay, 5, 0), **ARGS)
    assert (full.n_gpu_layers, full.n_cpu_moe, full.speed) == (5, 0, "gpu")
    one_less = free_for(lay, 5, 0) - 1
    p = planner.plan(lay, free_bytes=one_less, **ARGS)
    assert (p.n_gpu_layers, p.n_cpu_moe, p.speed) == (5, 1, "experts-cpu")   # attention stays, experts go
    p = planner.plan(lay, free_bytes=free_for(lay, 5, 3), **ARGS)
    assert (p.n_gpu_layers, p.n_cpu_moe) == (5, 3)
    assert p.gpu_bytes == gpu_cost(lay, 5, 3) and p.gpu_bytes < full.gpu_bytes
    assert p.host_bytes > full.host_bytes
    # not even every layer without its experts: whole layers go, the first ones, experts all on the CPU
    p = planner.plan(lay, free_bytes=free_for(lay, 5, 4) - 1, **ARGS)
    assert (p.n_gpu_layers, p.n_cpu_moe, p.speed) == (4, 4, "layers-cpu")
    assert "even with every expert on the CPU" in " ".join(p.warnings)
    p = planner.plan(lay, free_bytes=free_for(lay, 2, 4), **ARGS)
    assert p.n_gpu_layers == 2
    # the layer-only planner of before keeps fewer layers on the GPU for the same memory
    lo = planner.layer_only(lay, free_bytes=one_less, **ARGS)
    assert (lo.n_cpu_moe, lo.speed) == (0, "layers-cpu") and lo.n_gpu_layers < 5


def test_a_context_is_shrunk_only_when_not_one_layer_fits_and_it_says_so(moe):
    lay = placement.layout(moe)
    big = dict(ARGS, n_ctx=16384, n_parallel=8)
    small_ctx = dict(big, n_ctx=4096)
    free = free_for(lay, 1, 4, **small_ctx)
    assert planner.cost(lay, n_gpu_layers=1, n_cpu_moe=4, **{**ARGS, **big})["gpu"] > free - planner.MARGIN
    p = planner.plan(lay, free_bytes=free, **big)
    assert p.n_ctx == 4096 and p.n_gpu_layers >= 1
    assert [w for w in p.warnings if "shrunk" in w] == ["n_ctx shrunk from 16384 to 4096 per slot to fit the GPU"]
    nothing = planner.plan(lay, free_bytes=planner.MARGIN // 2, **big)   # nothing fits at any context
    assert (nothing.n_gpu_layers, nothing.n_cpu_moe, nothing.n_ctx, nothing.speed) == (0, 0, 16384, "cpu")
    assert not any("shrunk" in w for w in nothing.warnings)


def test_a_dense_model_moves_its_ffn_tensors_first(dense):
    lay = placement.layout(dense)
    assert not lay.moe and {t.name for t in lay.tensors if t.movable} == {
        f"blk.{i}.ffn_{w}.weight" for i in range(4) for w in ("gate", "up", "down")}
    p = planner.plan(lay, free_bytes=free_for(lay, 5, 0) - 1, **ARGS)
    assert (p.n_gpu_layers, p.n_cpu_moe) == (5, 1) and "FFN tensors of 1 layers" in p.describe()
    assert placement.layer_pattern(2, 4, moe=False) == r"^blk\.(0|1)\.ffn_(gate|up|down)\.weight$"


def test_pruned_experts_let_more_layers_keep_theirs_on_the_gpu(tmp_path):
    full = placement.layout(write_tiny_gguf(tmp_path / "e8.gguf", "qwen3moe", n_layer=4, n_expert=8))
    pruned = placement.layout(write_tiny_gguf(tmp_path / "e6.gguf", "qwen3moe", n_layer=4, n_expert=6))
    free = free_for(full, 5, 1)   # 3 of 4 layers' experts fit; 3 x 8 experts = 4 x 6
    a, b = planner.plan(full, free_bytes=free, **ARGS), planner.plan(pruned, free_bytes=free, **ARGS)
    assert (a.n_cpu_moe, b.n_cpu_moe, b.speed) == (1, 0, "gpu")


def test_a_hybrid_models_cache_is_counted_as_llama_cpp_allocates_it(tmp_path):
    """qwen35: a KV cache only on its attention layers, a recurrent state per sequence on the others,
    one more copy per snapshot when speculation is asked for by name (llama.cpp's RS buffer for
    this file at 2 sequences and 8 snapshots: 0.06 MiB, its KV buffer 0.12 MiB)."""
    lay = placement.layout(write_tiny_gguf(tmp_path / "q35.gguf", "qwen35", n_layer=4))
    assert lay.kv_layers == (1, 3)
    # (conv_kernel - 1) x (inner + 2 x groups x state) + state x inner floats: 3 x 64 + 256
    assert lay.rs_bytes == 4 * (3 * (32 + 2 * 2 * 8) + 8 * 32)
    kw = dict(n_gpu_layers=-1, n_cpu_moe=0, n_ctx=256, n_parallel=2, n_batch=64)
    plain, snap = planner.cost(lay, **kw), planner.cost(lay, n_rs_seq=8, **kw)
    rs = 2 * 2 * lay.rs_bytes                       # 2 recurrent layers x 2 sequences
    assert plain["gpu_kv"] == lay.kv_bytes_per_layer(512, "f16") * 2 + rs
    assert snap["gpu_kv"] - plain["gpu_kv"] == 8 * rs
    assert abs((snap["gpu_kv"] - lay.kv_bytes_per_layer(512, "f16") * 2) / 2**20 - 0.06) < 0.01
    dense = planner.Layout(**{**lay.__dict__, "kv_layers": None, "rs_bytes": 0})
    assert planner.cost(dense, **kw)["gpu_kv"] == lay.kv_bytes_per_layer(512, "f16") * 4


def test_explicit_placements_are_figured_not_changed(moe):
    lay = placement.layout(moe)
    p = planner.plan(lay, free_bytes=1, n_gpu_layers=-1, n_cpu_moe=2, **ARGS)
    assert (p.n_gpu_layers, p.n_cpu_moe, p.reason) == (-1, 2, "as asked")
    cpu = planner.plan(lay, free_bytes=0, gpu=False, **ARGS)
    assert (cpu.n_gpu_layers, cpu.gpu_bytes, cpu.speed) == (0, 0, "cpu")


def test_override_entries_split_on_commas_outside_repetition_counts():
    assert placement.split_entries(r"blk\.[0-9]{1,2}\.ffn_up_exps=CPU, output=CUDA0") == [
        r"blk\.[0-9]{1,2}\.ffn_up_exps=CPU", "output=CUDA0"]
    assert placement.parse_overrides("exps=cpu,attn=cuda0", ["CUDA0"]) == [("exps", "CPU"), ("attn", "CUDA0")]


@pytest.mark.parametrize("text, message", [
    (r"blk\.(\d+=CPU", r"override_tensor pattern 'blk\\\\.\(\\\\d\+' is not a valid regular expression"),
    ("exps=CUDA3", r"override_tensor device 'CUDA3' does not exist here; devices: CPU, CUDA0\."),
    ("exps", r"is not REGEX=DEVICE"),
    ("(?P<x>exps)=CPU", r"Python-only syntax"),
])
def test_bad_overrides_are_one_line_errors(moe, text, message):
    with pytest.raises(InvalidRequest, match=message) as e:
        placement.choose(moe, LoadSpec(str(moe), override_tensor=text), gpus=[GPU])
    assert "\n" not in str(e.value)


def test_a_pattern_that_places_nothing_is_a_warning_naming_it(moe):
    p, entries = placement.choose(moe, LoadSpec(str(moe), override_tensor=r"ffn_nothing=CPU"), gpus=[])
    assert p.warnings == [r"override_tensor pattern 'ffn_nothing' matches no tensor of moe.gguf; it places nothing"]
    assert entries == [("ffn_nothing", "CPU")]


def test_expert_options_on_a_dense_model_say_it_has_none_and_offer_ffn_offload(dense):
    for spec in (LoadSpec(str(dense), n_cpu_moe=2), LoadSpec(str(dense), cpu_moe=True)):
        with pytest.raises(InvalidRequest, match=r"dense model, it has no expert tensors.*override_tensor "
                                                 r"'\^blk\\\.\\d\+\\\.ffn_\(gate\|up\|down\)\\\.weight\$=CPU'"):
            placement.choose(dense, spec, gpus=[GPU])


def test_more_overrides_than_llama_cpp_takes_are_refused(moe, monkeypatch):
    monkeypatch.setattr(placement, "max_overrides", lambda: 3)
    placement.choose(moe, LoadSpec(str(moe), override_tensor="a=CPU,b=CPU"), gpus=[])
    with pytest.raises(InvalidRequest, match=r"3 entries; llama.cpp takes at most 2 \(llama_max_tensor_buft"):
        placement.choose(moe, LoadSpec(str(moe), override_tensor="a=CPU,b=CPU", n_cpu_moe=1), gpus=[])


def test_a_budget_too_small_for_the_non_expert_part_says_how_much_is_needed(moe):
    lay = placement.layout(moe)
    need = planner.cost(lay, n_gpu_layers=-1, n_cpu_moe=4, **ARGS)["gpu_weights"] + planner.MARGIN
    small = types.SimpleNamespace(**{**GPU.__dict__, "free_bytes": need - 1})
    with pytest.raises(InvalidRequest, match=rf"needs about {need / 2**30:.1f} GiB, and .* GiB is free"):
        placement.choose(moe, LoadSpec(str(moe), n_gpu_layers=-1, cpu_moe=True, **ARGS), gpus=[small])
    auto = placement.choose(moe, LoadSpec(str(moe), cpu_moe=True, **ARGS), gpus=[small])[0]
    assert auto.n_gpu_layers < 5 and auto.n_cpu_moe == 4   # auto layers: whole layers go instead


def test_bad_placements_load_nothing(moe, dense):
    from comfyui_a3b.runtime import Runtime

    rt = Runtime()
    for model, kw in ((moe, {"override_tensor": "(=CPU"}), (moe, {"override_tensor": "exps=GPU9"}),
                      (dense, {"n_cpu_moe": 1})):
        with pytest.raises(InvalidRequest):
            rt.load(str(model), **kw)
    assert rt.store.loaded() == [] and rt.store.weight_loads == 0


def test_llama_cpps_account_of_a_load_is_read_back():
    text = ("load_tensors: tensor blk.0.ffn_up_exps.weight (0 MiB f32) buffer type overridden to CPU\n"
            "load_tensors: tensor blk.1.ffn_up_exps.weight (0 MiB f32) buffer type overridden to CPU\n"
            "load_tensors:        CUDA0 model buffer size =   100.50 MiB\n"
            "load_tensors:   CPU_Mapped model buffer size =    12.00 MiB\n"
            "llama_kv_cache:      CUDA0 KV buffer size =     8.00 MiB\n"
            "llama_context:      CUDA0 compute buffer size =    30.00 MiB\n")
    m = placement.measured_from_log(text)
    assert m["overridden_tensors"] == {"CPU": 2}
    assert m["buffers"] == {"model:CUDA0": int(100.5 * 2**20), "model:CPU_Mapped": 12 << 20, "KV:CUDA0": 8 << 20,
                            "compute:CUDA0": 30 << 20}


def test_placement_options_are_part_of_the_weights_key(moe):
    from comfyui_a3b.runtime.llama.local_engine import ENGINE

    keys = {ENGINE.weights_key(LoadSpec(str(moe), **kw)) for kw in
            ({}, {"cpu_moe": True}, {"n_cpu_moe": 2}, {"override_tensor": "exps=CPU"})}
    assert len(keys) == 4


def test_a_smaller_placement_is_offered_only_where_experts_can_still_move(moe):
    from comfyui_a3b.runtime.llama.local_engine import ENGINE

    lay = placement.layout(moe)
    spec = LoadSpec(str(moe), **ARGS)
    full = planner.plan(lay, free_bytes=free_for(lay, 5, 0), **ARGS)
    info = types.SimpleNamespace(path=str(moe), n_cpu_moe=0, placement=full.as_dict())
    give = full.gpu_bytes - gpu_cost(lay, 5, 2)
    assert ENGINE.smaller_placement(spec, info, give) == gpu_cost(lay, 5, 2)
    # the load measured twice what was planned: the bytes asked for are real ones, half as many planned
    twice = types.SimpleNamespace(path=str(moe), n_cpu_moe=0,
                                  placement={**full.as_dict(), "measured": {"gpu_vs_expected": 2.0}})
    assert ENGINE.smaller_placement(spec, twice, 2 * give) == gpu_cost(lay, 5, 2)
    too_much = full.gpu_bytes - gpu_cost(lay, 5, 4) + 1      # would need whole layers to go: unload instead
    assert ENGINE.smaller_placement(spec, info, too_much) is None
    assert ENGINE.smaller_placement(LoadSpec(str(moe), n_gpu_layers=-1, **ARGS), info, give) is None
    cpu = types.SimpleNamespace(path=str(moe), n_cpu_moe=0, placement={**full.as_dict(), "gpu": False})
    assert ENGINE.smaller_placement(spec, cpu, give) is None


# -- ComfyUI asks for VRAM: a smaller placement first -----------------------------------------------------
@pytest.fixture
def comfy(monkeypatch, fake_engine):
    from comfyui_a3b.nodes import vram

    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models = []
    mm.get_torch_device = lambda: "cuda:0"
    for name, mod in (("comfy.model_management", mm), ("folder_paths", types.ModuleType("folder_paths")),
                      ("execution", types.ModuleType("execution"))):
        monkeypatch.setitem(sys.modules, name, mod)
    vram.REGISTRY.reset()
    assert vram.install()
    yield mm
    get_runtime().unload()
    get_runtime().store.remove_listener(vram._listener)
    vram.REGISTRY.reset()


def test_comfyui_asking_for_less_than_we_hold_gets_a_smaller_placement_not_an_unload(comfy, fake_engine,
                                                                                  monkeypatch):
    from comfyui_a3b.nodes import vram

    rt = get_runtime()
    spec = rt.spec("fake://gpu?gpu_layers=30")
    rt.load(spec)
    [entry] = comfy.current_loaded_models
    held = entry.nbytes
    caps, loads = [], fake_engine.loads
    original = fake_engine.load_weights

    def load_weights(s):
        caps.append(handover.cap_bytes())
        return original(s)

    monkeypatch.setattr(fake_engine, "load_weights", load_weights, raising=False)
    monkeypatch.setattr(fake_engine, "smaller_placement", lambda s, info, n: held - n, raising=False)
    assert entry.model_unload(held // 4) is False          # still loaded: ComfyUI keeps the entry
    assert rt.loaded(spec) is not None and fake_engine.loads == loads + 1 and caps == [held - held // 4]
    assert comfy.current_loaded_models == [entry] and vram.REGISTRY.managed[spec] is entry
    assert handover.cap_bytes() is None                      # the cap was for that reload only
    [h] = vram.status()["managed"][0]["handovers"]
    assert h["asked_bytes"] == held // 4 and h["seconds"] >= 0
    # more than we hold, or no smaller placement: unloaded as before
    monkeypatch.setattr(fake_engine, "smaller_placement", lambda s, info, n: None, raising=False)
    assert entry.model_unload(1) is True and rt.loaded(spec) is None


def test_comfyui_asking_for_all_we_hold_unloads(comfy, fake_engine, monkeypatch):
    rt = get_runtime()
    spec = rt.spec("fake://gpu?gpu_layers=30")
    rt.load(spec)
    [entry] = comfy.current_loaded_models
    monkeypatch.setattr(fake_engine, "smaller_placement", lambda s, info, n: 1, raising=False)
    assert entry.model_unload(entry.nbytes) is True and rt.loaded(spec) is None
    monkeypatch.setenv("A3B_VRAM_POLICY", "resident")
    rt.load(spec)
    [entry] = [e for e in comfy.current_loaded_models if e is not entry]
    assert entry.model_unload(1) is False and not entry.handovers


# -- slow: the real tiny model -----------------------------------------------------------------------------
def _events(rt, path, **kw):
    from comfyui_a3b.runtime import ConfidenceConfig, preset

    spec = rt.spec(str(path), n_ctx=128, n_parallel=1, **kw)
    stream = rt.submit(prompt_tokens=[1, 260, 261, 262, 263], model=spec, chat=False, max_tokens=8,
                       sampling=preset("greedy"), confidence=ConfidenceConfig(enabled=True), logprobs=3)
    evs = [(e.token, e.entropy, e.logprob, e.top_logprobs) for e in stream if e.is_token]
    return evs, rt.loaded(spec)


@pytest.mark.slow
def test_experts_on_the_cpu_buffer_type_give_the_default_placements_logits(moe):
    from comfyui_a3b.runtime import Runtime

    rt = Runtime()
    default, m0 = _events(rt, moe)
    moved, m1 = _events(rt, moe, cpu_moe=True)
    assert len(default) == 8 and moved == default
    assert rt.store.weight_loads == 2                     # two placements, two copies
    p0, p1 = m0.info.placement, m1.info.placement
    assert p0["overrides"] == [] and p0["measured"]["overridden_tensors"] == {}
    # the override really reached llama.cpp: it placed every expert tensor (3 per layer) on the CPU type
    assert p1["overrides"] == [r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_(ch)?exps=CPU"]
    assert p1["measured"]["overridden_tensors"] == {"CPU": 12} and m1.info.n_cpu_moe == 4
    status = {m["spec"]["cpu_moe"]: m for m in rt.status()["models"]}
    assert status[True]["placement"]["measured"]["overridden_tensors"] == {"CPU": 12}
    again, _ = _events(rt, moe, cpu_moe=True)   # its prompt's KV cache is reused: the same tokens
    assert [e[0] for e in again] == [e[0] for e in default] and rt.store.weight_loads == 2   # loaded once
    rt.unload()


# -- the surfaces: CLI, language-server settings, the loader node ------------------------------------------
def test_the_cli_flags_reach_the_spec_and_a_bad_placement_is_one_line(dense, capsys):
    from comfyui_a3b import cli

    args = cli.build_parser().parse_args(["generate", "hi", "--cpu-moe", "--n-cpu-moe", "3", "-ot", "a=CPU",
                                          "--override-tensor", "b=CUDA0"])
    spec = cli._spec(get_runtime(), args)
    assert (spec.cpu_moe, spec.n_cpu_moe, spec.override_tensor) == (True, 3, "a=CPU,b=CUDA0")
    plain = cli._spec(get_runtime(), cli.build_parser().parse_args(["generate", "hi"]))
    assert (plain.cpu_moe, plain.n_cpu_moe, plain.override_tensor) == (False, 0, None)
    assert cli.main(["generate", "hi", "--model", str(dense), "--n-cpu-moe", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("a3b: error: --n-cpu-moe=2: dense.gguf is a dense model") and "\n" not in err


def test_the_language_server_settings_take_the_placement():
    from comfyui_a3b.lsp_server import config as cfg

    s, errors = cfg.apply(cfg.Settings(), {"cpuMoe": True, "nCpuMoe": 4, "overrideTensor": "exps=CPU"})
    assert errors == [] and (s.cpu_moe, s.n_cpu_moe, s.override_tensor) == (True, 4, "exps=CPU")
    _, errors = cfg.apply(cfg.Settings(), {"nCpuMoe": -1, "cpuMoe": "yes"})
    assert len(errors) == 2 and "nCpuMoe" in errors[0] + errors[1]
    assert set(cfg.LOAD_FIELDS) <= {f for f in LoadSpec.__dataclass_fields__}


def test_the_loader_node_passes_the_placement(fake_engine):
    from comfyui_a3b.nodes import defs

    kw = {**defs.LOADER.defaults(), "model": "fake://moe", "cpu_moe": True, "n_cpu_moe": 2, "override_tensor": " "}
    (spec,), _ = defs._run_loader("1", **kw)
    assert (spec.cpu_moe, spec.n_cpu_moe, spec.override_tensor) == (True, 2, None)
    get_runtime().unload()


def test_a_concrete_placement_attaches_only_to_a_copy_placed_the_same_way():
    from comfyui_a3b.runtime.models.store import _Entry, placed

    info = types.SimpleNamespace(n_gpu_layers=5, n_layer=4, n_cpu_moe=2)
    auto = LoadSpec("m.gguf")
    e = _Entry(auto, types.SimpleNamespace(info=info), ("k",), 0)
    assert placed(auto, info) == LoadSpec("m.gguf", n_gpu_layers=5, n_cpu_moe=2)
    assert e.same_layers(auto)                                              # auto: any placement
    assert e.same_layers(LoadSpec("m.gguf", n_gpu_layers=-1, n_cpu_moe=2))  # the placement it resolved to
    assert not e.same_layers(LoadSpec("m.gguf", n_gpu_layers=-1))            # every expert on the GPU: another
    assert not e.same_layers(LoadSpec("m.gguf", n_gpu_layers=-1, cpu_moe=True))
    assert not e.same_layers(LoadSpec("m.gguf", n_gpu_layers=3, n_cpu_moe=2))


def test_inside_comfyui_the_planner_leaves_what_comfyui_keeps_for_inference(comfy, fake_engine, monkeypatch):
    from comfyui_a3b.nodes import comfy as comfy_glue, core

    comfy.minimum_inference_memory = lambda: 1 << 30
    comfy.extra_reserved_memory = lambda: 1 << 28
    seen = []
    original = fake_engine.load_weights

    def load_weights(s):
        seen.append(handover.reserve_bytes())
        return original(s)

    monkeypatch.setattr(fake_engine, "load_weights", load_weights, raising=False)
    core.load_model("fake://reserve", vram_reserve=comfy_glue.inference_reserve)
    assert seen == [(1 << 30) + (1 << 28)] and handover.reserve_bytes() == 0


def test_a_shrunk_context_reaches_the_loaded_model_and_its_status(moe, monkeypatch):
    """The whole auto path with a pretended GPU (llama.cpp's CPU build runs what it is given on the CPU)."""
    from comfyui_a3b.runtime import Runtime
    from comfyui_a3b.runtime.llama import fitting

    lay = placement.layout(moe)
    big = dict(n_ctx=16384, n_parallel=8, n_batch=64)
    free = free_for(lay, 1, 4, **dict(big, n_ctx=4096))
    monkeypatch.setattr(fitting, "gpus", lambda: [types.SimpleNamespace(**{**GPU.__dict__, "free_bytes": free})])
    rt = Runtime()
    m = rt.load(str(moe), **big)
    assert m.n_ctx_seq == 4096 and m.spec.n_ctx == 16384
    p = rt.status()["models"][0]["placement"]
    assert (p["n_ctx"], p["n_ctx_asked"], p["n_cpu_moe"]) == (4096, 16384, 4)
    assert "n_ctx shrunk from 16384 to 4096 per slot to fit the GPU" in p["warnings"]
    assert p["measured"]["overridden_tensors"] == {"CPU": 12}
    other = rt.load(str(moe), n_ctx=128, n_parallel=1)    # the same weights, a context that was not shrunk
    assert other.n_ctx_seq == 128 and rt.store.weight_loads == 1
    rt.unload()


@pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"), reason="set COMFYUI_DIR to a ComfyUI checkout")
def test_comfyuis_own_free_memory_gets_a_smaller_placement_first(tmp_path):
    """ComfyUI's real free_memory asks our entry for the bytes it lacks: a smaller placement gives them
    and the model stays listed and loaded; asked for more than it holds, it is unloaded."""
    tests = Path(__file__).resolve().parent
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{os.environ["COMFYUI_DIR"]!r}, {str(tests)!r}]
        sys.argv = ["main.py", "--cpu"]
        import comfy.options; comfy.options.enable_args_parsing()
        import comfy.model_management as mm, folder_paths
        import fakeengine; engine = fakeengine.install()
        from comfyui_a3b.nodes import vram
        from comfyui_a3b.runtime import get_runtime
        assert vram.install()
        rt = get_runtime()
        spec = rt.spec("fake://gpu?gpu_layers=30")
        rt.load(spec)
        [entry] = mm.current_loaded_models
        held = entry.nbytes
        engine.smaller_placement = lambda s, info, n: held - n
        # 1 GiB free, 2 GiB asked for: 1 GiB lacking
        mm.get_free_memory = lambda dev=None, torch_free_too=False: (1 << 30, 0) if torch_free_too else 1 << 30
        loads = engine.loads
        mm.free_memory(2 << 30, mm.get_torch_device())
        h = vram.status()["managed"][0]["handovers"]
        print("smaller", len(mm.current_loaded_models), rt.loaded(spec) is not None, engine.loads - loads,
              h[0]["asked_bytes"] == 1 << 30)
        mm.free_memory(held * 4, mm.get_torch_device())
        print("unloaded", len(mm.current_loaded_models), rt.loaded(spec) is not None)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "A3B_CACHE": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.split("\n")
    assert "smaller 1 True 1 True" in lines and "unloaded 0 False" in lines, p.stdout


def test_giving_memory_back_reloads_the_real_model_with_more_experts_in_ram(moe, monkeypatch):
    """runtime/models/handover.py over the llama.cpp engine, with a pretended GPU (the CPU build runs it all)."""
    from comfyui_a3b.runtime import Runtime
    from comfyui_a3b.runtime.llama import fitting

    lay = placement.layout(moe)
    monkeypatch.setattr(fitting, "gpus", lambda: [types.SimpleNamespace(**{**GPU.__dict__,
                                                                          "free_bytes": free_for(lay, 5, 0)})])
    rt = Runtime()
    spec = rt.spec(str(moe), **ARGS)
    m = rt.load(spec)
    assert (m.info.n_gpu_layers, m.info.n_cpu_moe) == (5, 0)
    give = gpu_cost(lay, 5, 0) - gpu_cost(lay, 5, 2)
    res = handover.give_back(rt, spec, give)
    m2 = rt.loaded(spec)
    assert res["n_cpu_moe"] == m2.info.n_cpu_moe == 2 and res["gpu_bytes"] == gpu_cost(lay, 5, 2)
    assert m2.info.placement["measured"]["overridden_tensors"] == {"CPU": 6} and rt.store.weight_loads == 2
    assert handover.give_back(rt, spec, gpu_cost(lay, 5, 2)) is None     # only whole layers would free that
    assert rt.loaded(spec) is m2
    rt.unload()
