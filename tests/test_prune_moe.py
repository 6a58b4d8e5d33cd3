"""Mixture-of-experts pruning (prune/experts/) on tiny random qwen3moe and qwen35moe GGUFs that the
tests write, calibrated and checked through real llama.cpp (no torch)."""
from __future__ import annotations

import numpy as np
import pytest
from tinygguf import write_tiny_gguf

from comfyui_a3b.prune import PruneConfig, prune
from comfyui_a3b.prune.experts.layout import check_moe_layout
from comfyui_a3b.prune.experts.plan import MoEPlan
from comfyui_a3b.prune.experts.stats import ExpertProbe
from comfyui_a3b.prune.experts.write import write_pruned
from comfyui_a3b.prune.errors import InvalidRequest, UnsupportedArchitecture
from comfyui_a3b.runtime.llama.evaluate import LlamaEval
from comfyui_a3b.prune.source import SourceModel
from comfyui_a3b.runtime import inspect_gguf

E = 8
DEAD = {0: [1, 4, 6], 1: [0, 3, 5]}
FAST = dict(calib_windows=4, seq_len=64, recover_steps=0)
SEQ = [1] + [int(x) for x in np.random.default_rng(1).integers(3, 271, 40)]


def plant_dead_experts(name: str, v: np.ndarray) -> np.ndarray:
    """Every token embedding gets a large constant first component, which RMS norm keeps dominant in the
    FFN input; the router rows of the DEAD experts weigh it strongly negative (they never reach the
    top 2), the live rows not at all (their routing depends on the token). Dead experts' outputs are
    scaled near zero, and attention is damped so that routing stays token-dependent."""
    v = v.copy()
    if name == "token_embd.weight":
        v[:, 0] = 1.0
    if not name.startswith("blk."):
        return v
    il, part = int(name.split(".")[1]), name.split(".")[2]
    if part == "ffn_gate_inp":
        v *= 4.0
        v[:, 0] = 0.0
        v[DEAD[il], 0] = -4.0
    elif part == "ffn_down_exps":
        v[DEAD[il]] *= 1e-3
    elif part == "attn_output":
        v *= 0.1
    return v


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe-planted")
    return {a: write_tiny_gguf(d / f"{a}.gguf", a, n_ctx=256, n_expert=E, n_expert_used=2, seed=4,
                               tensor_hook=plant_dead_experts) for a in ("qwen3moe", "qwen35moe")}


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def _logits(path, seq=SEQ):
    with LlamaEval(path, n_ctx=64, n_threads=2) as ev:
        return ev.logits(seq)


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean KL(p || q) over positions, in nats."""
    lp = p_logits - np.logaddexp.reduce(p_logits, -1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, -1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


#: qwen3moe in the fast tier, qwen35moe (a slower load) in the slow one
ARCHS = ("qwen3moe", pytest.param("qwen35moe", marks=pytest.mark.slow))


@pytest.mark.parametrize("arch", ARCHS)
def test_dead_experts_are_exactly_the_ones_removed_and_the_distribution_is_kept(planted, tmp_path, cache, arch):
    src_path = planted[arch]
    base = _logits(src_path)
    out = tmp_path / "reap.gguf"
    res = prune(src_path, out, PruneConfig(keep=1.0, experts_keep=5 / 8, **FAST), progress=False, cache_dir=cache)
    a = inspect_gguf(out).a3b
    assert [list(a[f"a3b.experts.removed.{il}"]) for il in (0, 1)] == [DEAD[0], DEAD[1]]
    assert a["a3b.experts.method"] == "reap" and a["a3b.n_expert"] == 5 and a["a3b.n_expert_source"] == E
    assert res.metadata["calib.engine"] == "llama.cpp"
    pruned = _logits(out)
    kl_dead = _kl(base, pruned)
    assert abs(kl_dead) < 1e-6 and (pruned.argmax(-1) == base.argmax(-1)).all()
    # frequency finds them too: they are never routed
    freq = prune(src_path, tmp_path / "freq.gguf", PruneConfig(keep=1.0, experts_keep=5 / 8, expert_method="frequency",
                                                               **FAST), progress=False, cache_dir=cache)
    assert [freq.metadata[f"experts.removed.{il}"] for il in (0, 1)] == [DEAD[0], DEAD[1]]
    # removing as many live experts changes the distribution a lot
    src = SourceModel(src_path, torch_reference=False)
    lay = check_moe_layout(src)
    live_out = {il: [e for e in range(E) if e not in DEAD[il]][:3] for il in DEAD}
    plan = MoEPlan({il: np.array([e for e in range(E) if e not in live_out[il]]) for il in DEAD})
    write_pruned(src, lay, plan, tmp_path / "live.gguf", lay.n_ff_exp, lay.n_ff_shexp, {})
    kl_live = _kl(base, _logits(tmp_path / "live.gguf"))
    assert kl_live > 0.05 and kl_live > 1e4 * max(abs(kl_dead), 1e-9)


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_one_reproduces_the_source_logits(planted, tmp_path, cache, arch):
    out = tmp_path / "same.gguf"
    res = prune(planted[arch], out, PruneConfig(keep=1.0, experts_keep=1.0, **FAST), progress=False, cache_dir=cache)
    assert np.array_equal(_logits(out), _logits(planted[arch]))
    assert res.metadata["calib.engine"] == "none"  # nothing to rank: no calibration pass


@pytest.mark.slow
def test_experts_and_expert_neurons_with_a_shared_expert(planted, tmp_path, cache):
    out = tmp_path / "both.gguf"
    res = prune(planted["qwen35moe"], out, PruneConfig(keep=0.5, method="a3b", experts_keep=0.5, **FAST),
                progress=False, cache_dir=cache)
    info = inspect_gguf(out)
    assert (info.expert_count, info.expert_used_count, info.expert_feed_forward_length) == (4, 2, 64)
    assert res.n_ff == 64 and res.n_ff_source == 128
    a = info.a3b
    assert a["a3b.selection"] == "router-weighted-wanda" and a["a3b.n_ff_shexp"] == 32
    assert a["a3b.shexp.selection"] == "wanda"
    src = SourceModel(out, torch_reference=False)
    shape = {n: tuple(reversed(t.shape)) for n, t in src.tensors.items()}
    assert shape["blk.1.ffn_gate_exps.weight"] == (4, 64, 64) and shape["blk.1.ffn_down_exps.weight"] == (4, 64, 64)
    assert shape["blk.1.ffn_gate_inp.weight"] == (4, 64) and shape["blk.1.ffn_down_shexp.weight"] == (64, 32)
    assert shape["blk.1.ffn_up_shexp.weight"] == (32, 64) and shape["blk.1.ffn_gate_inp_shexp.weight"] == (64,)
    # kept gate rows are the source's own values, expert by expert
    full = SourceModel(planted["qwen35moe"], torch_reference=False)
    kept = [e for e in range(E) if e not in a["a3b.experts.removed.1"]]
    g_src, g_out = full.weight("blk.1.ffn_gate_exps.weight"), src.weight("blk.1.ffn_gate_exps.weight")
    for j, e in enumerate(kept):
        assert all((g_src[e] == row).all(1).any() for row in g_out[j])
    assert np.isfinite(_logits(out)).all()


@pytest.mark.slow
def test_quantised_experts_keep_their_types(planted, tmp_path, cache):
    from comfyui_a3b.runtime.llama.quantize import quantize_file as quantize

    q = tmp_path / "q8.gguf"
    quantize(planted["qwen3moe"], q, 7)  # LLAMA_FTYPE_MOSTLY_Q8_0
    types = {n: t.tensor_type.name for n, t in SourceModel(q, torch_reference=False).tensors.items()}
    assert types["blk.0.ffn_down_exps.weight"] == "Q8_0"
    for keep, ek in ((1.0, 5 / 8), (0.5, 5 / 8)):
        out = tmp_path / f"q-{keep}.gguf"
        prune(q, out, PruneConfig(keep=keep, method="wanda", experts_keep=ek, **FAST), progress=False,
              cache_dir=cache)
        assert {n: t.tensor_type.name for n, t in SourceModel(out, torch_reference=False).tensors.items()} == types
    # removing the dead experts of the quantised file: its own next-token distribution again
    assert abs(_kl(_logits(q), _logits(tmp_path / "q-1.0.gguf"))) < 1e-6
    assert np.isfinite(_logits(tmp_path / "q-0.5.gguf")).all()


def test_bad_inputs_are_named(planted, tmp_path, cache):
    for r in (0.0, 1.5, float("nan"), -0.5):
        with pytest.raises(InvalidRequest, match="experts keep ratio must be in"):
            PruneConfig(experts_keep=r).validate()
    dense = write_tiny_gguf(tmp_path / "dense.gguf", "qwen3")
    with pytest.raises(InvalidRequest, match="dense model.*--keep"):
        prune(dense, tmp_path / "o.gguf", PruneConfig(keep=1.0, experts_keep=0.5, **FAST), progress=False,
              cache_dir=cache)
    with pytest.raises(InvalidRequest, match="keeps 1 of the 8 experts.*fewer than the 2.*at least 0.25"):
        prune(planted["qwen3moe"], tmp_path / "o.gguf", PruneConfig(keep=1.0, experts_keep=0.15, **FAST),
              progress=False, cache_dir=cache)
    # the boundary: as many experts as are routed per token
    edge = prune(planted["qwen3moe"], tmp_path / "edge.gguf", PruneConfig(keep=1.0, experts_keep=0.25, **FAST),
                 progress=False, cache_dir=cache)
    assert (inspect_gguf(edge.path).expert_count, inspect_gguf(edge.path).expert_used_count) == (2, 2)
    assert np.isfinite(_logits(edge.path)).all()
    other = write_tiny_gguf(tmp_path / "other.gguf", "qwen2moe", moe=True)
    with pytest.raises(UnsupportedArchitecture, match="'qwen2moe'.*qwen3moe, qwen35moe"):
        prune(other, tmp_path / "o.gguf", PruneConfig(keep=1.0, experts_keep=0.5, **FAST), progress=False,
              cache_dir=cache)
    ragged = write_tiny_gguf(tmp_path / "ragged.gguf", "qwen3moe", n_ff=[128, 96], n_expert=8)
    with pytest.raises(UnsupportedArchitecture, match="differing widths"):
        prune(ragged, tmp_path / "o.gguf", PruneConfig(keep=1.0, experts_keep=0.5, **FAST), progress=False,
              cache_dir=cache)
    with pytest.raises(InvalidRequest, match="recover-steps 0"):
        prune(planted["qwen3moe"], tmp_path / "o.gguf", PruneConfig(keep=1.0, experts_keep=0.5, recover_steps=5),
              progress=False, cache_dir=cache)
    assert not (tmp_path / "o.gguf").exists()


def test_interrupt_mid_write_leaves_nothing_under_the_final_name(planted, tmp_path, cache):
    out = tmp_path / "o.gguf"
    cfg = PruneConfig(keep=1.0, experts_keep=0.5, **FAST)
    n = {"calls": 0}

    def stop_while_writing():
        n["calls"] += 1
        return n["calls"] > 4 + 12  # four calibration windows, then a dozen tensors written
    with pytest.raises(KeyboardInterrupt):
        prune(planted["qwen3moe"], out, cfg, progress=False, cache_dir=cache, should_stop=stop_while_writing)
    assert not out.exists() and list(tmp_path.glob(".o.gguf*")) == []
    res = prune(planted["qwen3moe"], out, cfg, progress=False, cache_dir=cache)
    assert res.metadata["calib.cached"] and inspect_gguf(out).expert_count == 4


@pytest.mark.slow
def test_cli_prunes_experts_and_inspect_shows_them(planted, tmp_path, capsys):
    from comfyui_a3b.cli import main

    out = tmp_path / "cli.gguf"
    rc = main(["prune", str(planted["qwen3moe"]), "--experts-keep", "0.5", "--calib-windows", "4", "--seq-len", "64",
               "--out", str(out), "--quiet", "--cache-dir", str(tmp_path / "c")])
    text = capsys.readouterr().out
    assert rc == 0 and "experts 4/8 per layer (reap), 2 used per token, expert FFN width 128/128" in text
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "experts / used per token" in text and "4 / 2" in text and "a3b.experts.removed.0" in text
    # an MoE model without --experts-keep: narrower experts, one-shot (no recovery asked for)
    out2 = tmp_path / "narrow.gguf"
    assert main(["prune", str(planted["qwen3moe"]), "--keep", "0.5", "--method", "wanda", "--calib-windows", "4",
                 "--seq-len", "64", "--out", str(out2), "--quiet", "--cache-dir", str(tmp_path / "c")]) == 0
    assert "experts 8/8 per layer (none), 2 used per token, expert FFN width 64/128" in capsys.readouterr().out
    dense = write_tiny_gguf(tmp_path / "dense.gguf", "llama")
    assert main(["prune", str(dense), "--experts-keep", "0.5", "--out", str(tmp_path / "d.gguf"), "--quiet"]) == 2
    assert "dense model" in capsys.readouterr().err


def test_cli_defaults_with_experts_keep():
    import argparse

    from comfyui_a3b.prune import cli as prune_cli

    p = argparse.ArgumentParser()
    prune_cli.add_arguments(p)
    cfg = prune_cli.config_from_args(p.parse_args(["m.gguf", "--experts-keep", "0.5"]))
    assert (cfg.experts_keep, cfg.keep, cfg.recover_steps, cfg.expert_method) == (0.5, 1.0, 0, "reap")
    cfg = prune_cli.config_from_args(p.parse_args(["m.gguf", "--experts-keep", "0.5", "--keep", "0.75"]))
    assert (cfg.experts_keep, cfg.keep) == (0.5, 0.75)
    assert prune_cli.config_from_args(p.parse_args(["m.gguf"])) == PruneConfig()
    assert PruneConfig(experts_keep=1.0).key() == PruneConfig().key()  # dense variants keep their cache names
    assert PruneConfig(experts_keep=0.5).key() != PruneConfig().key()


def test_cached_variant_is_made_once(planted, tmp_path, monkeypatch):
    from comfyui_a3b.prune import cache, cached_variant

    kw = dict(keep=1.0, experts_keep=0.5, recover_steps=0, calib_windows=4, seq_len=64, cache_dir=tmp_path)
    path = cached_variant(planted["qwen3moe"], **kw)
    assert "-ereap0.5-" in path.name and inspect_gguf(path).expert_count == 4

    def fail(*a, **k):
        raise AssertionError("pruned again")
    monkeypatch.setattr(cache, "prune", fail)
    assert cached_variant(planted["qwen3moe"], **kw) == path


def test_expert_probe_reap_statistics_match_the_router(planted):
    """The probe's counts are the router's top-2 choices, and its REAP sums are router weight x output norm."""
    from comfyui_a3b.prune.calibration.llama_stats import LlamaCalibrator, PatternProbe

    probs = {}
    probe = ExpertProbe(2, E, neurons=True)
    spy = PatternProbe(r"ffn_moe_probs-(\d+)", lambda k, n: probs.setdefault(k, n.numpy()[0, 0]), weight=False)
    with LlamaCalibrator(planted["qwen3moe"], 64, n_threads=2) as cal:
        cal.run([probe, spy], [SEQ])
    st = probe.stats()
    for il in (0, 1):
        p = probs[il]
        top2 = np.argsort(-p, -1, kind="stable")[:, :2]
        assert (st.count[il] == np.bincount(top2.ravel(), minlength=E)).all()
        # the weights applied are the top-2 probabilities renormalised: they sum to one per token
        assert st.weight[il].sum() == pytest.approx(len(SEQ), rel=1e-5)
        assert (st.reap[il] > 0).sum() == (st.count[il] > 0).sum()
        assert st.count[il][DEAD[il]].sum() == 0
        assert st.hsq.shape == (2, E, 128) and (st.hsq[il][DEAD[il]] == 0).all()


@pytest.mark.slow  # the loader's calibration defaults: 64 windows of 256 tokens
def test_the_loader_serves_an_expert_pruned_variant_made_once(planted, tmp_path, monkeypatch):
    from comfyui_a3b.nodes import core, defs

    assert defs.PRUNE.defaults()["experts_keep"] == 1.0
    monkeypatch.setenv("A3B_CACHE", str(tmp_path / "cache"))
    core.VARIANTS.reset()
    # the widget's -1 (unset) means no recovery with expert pruning, which is one-shot; 0 says the same
    path = core.pruned_variant(planted["qwen3moe"], 1.0, None, -1, 1.0, 0.5)
    assert path.is_relative_to(tmp_path / "cache") and inspect_gguf(path).expert_count == 4
    core.VARIANTS.reset()
    assert core.pruned_variant(planted["qwen3moe"], 1.0, None, 0, 1.0, 0.5) == path  # from the disk cache
    with pytest.raises(core.NodeError, match="one-shot. Set recover_steps to 0"):   # a count is not dropped unsaid
        core.pruned_variant(planted["qwen3moe"], 1.0, None, 160, 1.0, 0.5)
    with pytest.raises(core.NodeError, match="experts_keep must be in"):
        core.pruned_variant(planted["qwen3moe"], 1.0, None, 0, 1.0, 0.0)


@pytest.mark.slow
def test_the_expert_pruning_bench_runs_at_a_tiny_size(tmp_path, monkeypatch):
    import json

    from comfyui_a3b.bench import bench_prune_moe, common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    assert bench_prune_moe.main(["--experts", "8", "--used", "2", "--layers", "2", "--embd", "64", "--ff", "64",
                                 "--calib-windows", "4", "--seq-len", "64", "--heldout-windows", "2"]) == 0
    r = json.loads((tmp_path / "bench_prune_moe.json").read_text())["results"]
    assert set(r) == {f"{k}/{m}" for k in ("random", "planted") for m in ("reap", "frequency", "random")}
    assert r["planted/reap"]["removed_dead_weak_layer0"] == [2, 2]  # REAP finds the planted experts
    assert (tmp_path / "bench_prune_moe.png").stat().st_size > 0


@pytest.mark.slow
def test_a_fused_gate_up_tensor_is_pruned_as_the_separate_ones(tmp_path, cache):
    """qwen35moe may store each expert's gate and up rows in one ffn_gate_up_exps: the same model written
    both ways gives the same logits, pruned or not."""
    kw = dict(n_ctx=256, n_expert=E, n_expert_used=2, seed=4, tensor_hook=plant_dead_experts)
    sep = write_tiny_gguf(tmp_path / "sep.gguf", "qwen35moe", **kw)
    fused = write_tiny_gguf(tmp_path / "fused.gguf", "qwen35moe", fused_gate_up=True, **kw)
    assert "blk.0.ffn_gate_up_exps.weight" in SourceModel(fused, torch_reference=False).tensors
    assert np.allclose(_logits(sep), _logits(fused), atol=1e-5)
    for method in ("a3b", "magnitude"):
        cfg = PruneConfig(keep=0.5, method=method, experts_keep=0.5, **FAST)
        a = prune(sep, tmp_path / f"sep-{method}.gguf", cfg, progress=False, cache_dir=cache)
        b = prune(fused, tmp_path / f"fused-{method}.gguf", cfg, progress=False, cache_dir=cache)
        assert a.metadata["experts.removed.1"] == b.metadata["experts.removed.1"]
        fused_t = SourceModel(b.path, torch_reference=False).tensors["blk.1.ffn_gate_up_exps.weight"]
        assert tuple(reversed(fused_t.shape)) == (4, 128, 64)
        assert np.allclose(_logits(a.path), _logits(b.path), atol=1e-4)
