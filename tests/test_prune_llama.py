"""Pruning calibrated through llama.cpp and written tensor by tensor, on tiny random GGUFs of every
supported architecture (qwen35 and gemma3 included) that the tests write. Real llama.cpp, real torch."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the prune extra (torch) is not installed")

from tinygguf import write_tiny_gguf  # noqa: E402

from comfyui_a3b.prune import PruneConfig, prune  # noqa: E402
from comfyui_a3b.prune.writing import gguf as stream  # noqa: E402
from comfyui_a3b.prune.errors import InvalidRequest, UnsupportedArchitecture  # noqa: E402
from comfyui_a3b.runtime.llama.evaluate import LlamaEval  # noqa: E402
from comfyui_a3b.prune.source import SourceModel  # noqa: E402
from comfyui_a3b.runtime import inspect_gguf  # noqa: E402

pytestmark = pytest.mark.slow

ARCHS = ("llama", "qwen2", "qwen3", "qwen35", "gemma3")
FAST = dict(calib_windows=8, seq_len=64, recover_steps=0, calibration="llama")
SEQ = [1, 5, 9, 200, 100, 17, 42, 260, 3, 77]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("prune-llama-tiny")
    return {a: write_tiny_gguf(d / f"tiny-{a}.gguf", a, n_ctx=512, n_ff=128, seed=3) for a in ARCHS}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A K-quant mix like the real Q4_K_M files: ffn_down Q4_K/Q6_K, 64-wide rows in the fallback Q5_0."""
    from comfyui_a3b.runtime.llama.quantize import quantize_file as quantize

    d = tmp_path_factory.mktemp("prune-mixed")
    f32 = write_tiny_gguf(d / "tiny-gemma3-f32.gguf", "gemma3", n_ctx=512, n_ff=512, n_layer=4, seed=5)
    out = d / "tiny-gemma3-q4km.gguf"
    quantize(f32, out, 15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    return out


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def _logits(path, seq=SEQ):
    with LlamaEval(path, n_ctx=64) as ev:
        return ev.logits(seq)


def _types(path) -> dict[str, str]:
    src = SourceModel(path, torch_reference=False)
    return {n: t.tensor_type.name for n, t in src.tensors.items()}


@pytest.mark.parametrize("arch", ("llama", "qwen3"))
def test_llama_cpp_statistics_agree_with_the_torch_reference(tiny, arch):
    from comfyui_a3b.prune.calibration import reference_stats as calibrate
    from comfyui_a3b.prune.calibration.llama_stats import FFNInputProbe, LlamaCalibrator
    from comfyui_a3b.prune.reference import RefModel

    rng = np.random.default_rng(0)
    wins = [[1] + [int(x) for x in rng.integers(3, 271, 63)] for _ in range(4)]
    src = SourceModel(tiny[arch])
    probe = FFNInputProbe(src.hp.n_layer, gram_layers=range(src.hp.n_layer))
    with LlamaCalibrator(tiny[arch], 64) as cal:
        cal.run([probe], wins)
    ref = calibrate.collect(RefModel.from_source(src), wins, src.sha256, progress=False)
    for i in range(src.hp.n_layer):
        a, b = probe.layer_stats(i), ref.layers[i]
        assert a.count == b.count == 4 * 64
        for x, y in ((a.sum, b.sum), (a.sumsq, b.sumsq), (a.sumabs, b.sumabs), (a.gram, b.gram)):
            assert np.abs(x - y).max() <= 2e-3 * np.abs(y).max()


def test_gemma_gram_is_weighted_by_each_tokens_ffn_output(tiny):
    """Gemma normalises the FFN output (post_ffw_norm): the Gram matrix weights token t by
    1 / mean(y_t^2), y_t = W_down h_t; checked against h recorded separately and W_down from the file."""
    from comfyui_a3b.prune.calibration.llama_stats import FFNInputProbe, LlamaCalibrator, PatternProbe
    from comfyui_a3b.prune.dense.llama_path import open_source

    src, layout = open_source(tiny["gemma3"])
    assert layout.post_norm and not open_source(tiny["llama"])[1].post_norm
    rng = np.random.default_rng(1)
    wins = [[2] + [int(x) for x in rng.integers(3, 271, 47)] for _ in range(3)]
    n = src.hp.n_layer
    seen: dict[int, list[np.ndarray]] = {}

    def keep_input(il, node):
        x = node.src(1).numpy()
        seen.setdefault(il, []).append(x.reshape(-1, x.shape[-1]).astype(np.float64))

    plain = FFNInputProbe(n, gram_layers=range(n))
    weighted = FFNInputProbe(n, gram_layers=range(n), weighted=True)
    raw = PatternProbe(r"blk\.(\d+)\.ffn_down\.weight", keep_input, ops=("MUL_MAT",))
    with LlamaCalibrator(tiny["gemma3"], 64) as cal:
        cal.run([plain, weighted, raw], wins)
    for il in range(n):
        h = np.concatenate(seen[il])
        y = h @ src.weight(f"blk.{il}.ffn_down.weight").astype(np.float64).T
        w = 1.0 / ((y * y).mean(1) + FFNInputProbe.eps)
        a, p = weighted.layer_stats(il), plain.layer_stats(il)
        want = (h * w[:, None]).T @ h
        assert np.abs(a.gram - want).max() <= 1e-3 * np.abs(want).max()
        assert np.allclose(a.gram_sum, w @ h, rtol=1e-3, atol=1e-6) and a.gram_count == pytest.approx(w.sum(), 1e-4)
        # the unweighted sums (scores, importance matrix) are the plain probe's; only the Gram differs
        assert np.array_equal(a.sumsq, p.sumsq) and p.gram_sum is None
        assert np.abs(a.gram / a.gram_count - p.gram / p.count).max() > 1e-3 * np.abs(p.gram / p.count).max()


@pytest.mark.parametrize("arch", ARCHS)
def test_pruned_file_loads_with_the_promised_width_and_metadata(tiny, tmp_path, cache, arch):
    out = tmp_path / f"{arch}-pruned.gguf"
    res = prune(tiny[arch], out, PruneConfig(keep=0.5, method="obs", **FAST), progress=False, cache_dir=cache)
    info = inspect_gguf(out)
    assert info.architecture == arch and info.feed_forward_length == 64 == res.n_ff
    a = info.a3b
    assert a["a3b.calib.engine"] == "llama.cpp" and a["a3b.n_ff"] == 64 and a["a3b.n_ff_source"] == 128
    assert a["a3b.selection"] == "obs-oneshot"
    assert a["a3b.calib.weighting"] == ("post-norm" if arch == "gemma3" else "uniform")
    assert a["a3b.source.sha256"] == SourceModel(tiny[arch], torch_reference=False).sha256
    src = SourceModel(out, torch_reference=False)
    for i in range(src.hp.n_layer):
        assert tuple(reversed(src.tensors[f"blk.{i}.ffn_up.weight"].shape)) == (64, 64)
        assert tuple(reversed(src.tensors[f"blk.{i}.ffn_down.weight"].shape)) == (64, 64)
    lg = _logits(out)
    assert np.isfinite(lg).all() and lg.shape == (len(SEQ), 271)


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_one_reproduces_the_source_logits(tiny, tmp_path, cache, arch):
    out = tmp_path / f"{arch}-keep1.gguf"
    prune(tiny[arch], out, PruneConfig(keep=1.0, **FAST), progress=False, cache_dir=cache)
    assert np.array_equal(_logits(out), _logits(tiny[arch]))


def test_mixed_quantised_file_keeps_every_tensors_type(mixed, tmp_path, cache):
    before = _types(mixed)
    assert {"Q4_K", "Q6_K"} & {before[n] for n in before if "ffn_down" in n}, before
    out = tmp_path / "mixed-pruned.gguf"
    res = prune(mixed, out, PruneConfig(keep=0.5, method="a3b", **{**FAST, "calib_windows": 16}), progress=False,
                cache_dir=cache)
    assert res.n_ff == 256  # a multiple of the K-quant block
    assert _types(out) == before
    src_full, src_pruned = SourceModel(mixed, torch_reference=False), SourceModel(out, torch_reference=False)
    keep = None
    for name, t in src_pruned.tensors.items():
        if name.endswith("ffn_up.weight"):  # kept rows are the source's bytes, not requantised
            rows = np.asarray(t.data)
            full = np.asarray(src_full.tensors[name].data)
            idx = [int(np.flatnonzero((full == r).all(1))[0]) for r in rows]
            assert idx == sorted(idx) and len(set(idx)) == 256
            keep = idx if keep is None else keep
    assert np.isfinite(_logits(out)).all()
    # keep 1.0 of the mixed file is its exact copy
    same = tmp_path / "mixed-keep1.gguf"
    prune(mixed, same, PruneConfig(keep=1.0, **FAST), progress=False, cache_dir=cache)
    assert np.array_equal(_logits(same), _logits(mixed))


def test_a_width_off_the_k_quant_block_falls_back_as_llama_quantize_does(mixed, tmp_path, cache):
    out = tmp_path / "mixed-align32.gguf"
    res = prune(mixed, out, PruneConfig(keep=0.8, method="wanda", align=32, **FAST), progress=False, cache_dir=cache)
    assert res.n_ff == 416
    before, after = _types(mixed), _types(out)
    fb = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
    for name, t in before.items():
        assert after[name] == (fb.get(t, t) if "ffn_down" in name else t)
    assert res.metadata["requant.fallback_tensors"] == 4
    assert np.isfinite(_logits(out)).all()


def test_unknown_architecture_is_named(tmp_path, cache):
    p = write_tiny_gguf(tmp_path / "alien.gguf", "alienarch")
    with pytest.raises(UnsupportedArchitecture, match="alienarch"):
        prune(p, tmp_path / "o.gguf", PruneConfig(keep=0.5, **FAST), progress=False, cache_dir=cache)


def test_mixture_of_experts_is_refused_with_the_reason(tmp_path, cache):
    # qwen3moe and qwen35moe go to expert pruning (test_prune_moe.py); other MoE architectures are named
    p = write_tiny_gguf(tmp_path / "moe.gguf", "qwen2moe", moe=True)
    with pytest.raises(UnsupportedArchitecture, match="mixture-of-experts.*'qwen2moe'"):
        prune(p, tmp_path / "o.gguf", PruneConfig(keep=0.5, **FAST), progress=False, cache_dir=cache)


def test_unchecked_ffn_layout_is_refused_by_name(tmp_path, cache):
    p = write_tiny_gguf(tmp_path / "granite.gguf", "granite")  # llama.cpp runs it; its layout is not checked here
    with pytest.raises(UnsupportedArchitecture, match="'granite'.*FFN layout"):
        prune(p, tmp_path / "o.gguf", PruneConfig(keep=0.5, **FAST), progress=False, cache_dir=cache)


def test_ffn_widths_that_differ_per_layer_are_refused(tmp_path, cache):
    p = write_tiny_gguf(tmp_path / "ragged.gguf", "gemma3", n_ff=[128, 96])
    with pytest.raises(UnsupportedArchitecture, match="differ per layer.*128"):
        prune(p, tmp_path / "o.gguf", PruneConfig(keep=0.5, **FAST), progress=False, cache_dir=cache)


def test_recovery_on_an_architecture_without_torch_reference_is_a_clear_error(tiny, tmp_path, cache):
    cfg = PruneConfig(keep=0.5, recover_steps=10, calib_windows=8, seq_len=64)
    with pytest.raises(UnsupportedArchitecture, match="recover-steps 0"):
        prune(tiny["gemma3"], tmp_path / "o.gguf", cfg, progress=False, cache_dir=cache)
    with pytest.raises(UnsupportedArchitecture, match="calibration llama"):
        prune(tiny["qwen35"], tmp_path / "o.gguf", PruneConfig(keep=0.5, calibration="torch", recover_steps=0),
              progress=False, cache_dir=cache)
    with pytest.raises(InvalidRequest, match="recover-steps 0"):
        prune(tiny["llama"], tmp_path / "o.gguf", PruneConfig(keep=0.5, calibration="llama", recover_steps=5),
              progress=False, cache_dir=cache)


def test_gpu_layers_on_a_cpu_build_is_a_clear_error(tiny, tmp_path, cache):
    from comfyui_a3b.runtime.llama import llama

    if llama().llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python has a GPU backend")
    with pytest.raises(InvalidRequest, match="CPU only"):
        prune(tiny["gemma3"], tmp_path / "o.gguf", PruneConfig(keep=0.5, method="wanda", n_gpu_layers=-1,
                                                                 **{k: v for k, v in FAST.items()}),
              progress=False, cache_dir=cache)
    assert not (tmp_path / "o.gguf").exists()


def test_not_enough_disk_is_refused_before_writing(tiny, tmp_path, cache, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 20, 10 << 20, 1 << 20))
    with pytest.raises(stream.NotEnoughDisk, match="free"):
        prune(tiny["qwen35"], tmp_path / "o.gguf", PruneConfig(keep=0.5, method="wanda", **FAST), progress=False,
              cache_dir=cache)
    assert list(tmp_path.glob("*o.gguf*")) == []


def test_interrupt_mid_calibration_leaves_nothing_and_resumes(tiny, tmp_path, cache, monkeypatch):
    from comfyui_a3b.prune.dense import llama_path as streamed

    out = tmp_path / "o.gguf"
    # one Gram matrix per pass: two passes for two layers; stop during the second
    monkeypatch.setattr(streamed, "gram_groups", lambda n, n_ff, budget: [[i] for i in range(n)])
    monkeypatch.setattr(streamed, "gram_bytes", lambda n_ff: 1 << 40)  # one Gram matrix held at a time
    monkeypatch.setattr(streamed, "spill_room", lambda *a: False)  # and no disk for the others: a pass each
    cfg = PruneConfig(keep=0.5, method="obs", **FAST)
    calls = {"n": 0}

    def stop_in_second_pass():
        calls["n"] += 1
        return calls["n"] > 8 + 3
    with pytest.raises(KeyboardInterrupt):
        prune(tiny["gemma3"], out, cfg, progress=False, cache_dir=cache, should_stop=stop_in_second_pass)
    assert not out.exists() and list(tmp_path.glob(".o.gguf*")) == []
    plans = list((cache / "plans").rglob("layer*.npz"))
    assert len(plans) == 1  # layer 0 was planned before the interrupt
    res = streamed.prune_streamed(tiny["gemma3"], out, cfg, progress=False, cache_dir=cache)
    assert res.metadata["calib.passes"] == 1  # only the missing layer was calibrated again
    ref = tmp_path / "ref.gguf"
    prune(tiny["gemma3"], ref, cfg, progress=False, cache_dir=tmp_path / "fresh-cache")
    assert np.array_equal(_logits(out), _logits(ref))


def test_interrupt_mid_write_leaves_nothing_under_the_final_name(tiny, tmp_path, cache):
    out = tmp_path / "o.gguf"
    cfg = PruneConfig(keep=0.5, method="wanda", **FAST)
    state = {"n": 0}

    def stop_while_writing():
        state["n"] += 1
        return state["n"] > 8 + 2 + 10  # eight calibration windows, two layers planned, ten tensors written
    with pytest.raises(KeyboardInterrupt):
        prune(tiny["llama"], out, cfg, progress=False, cache_dir=cache, should_stop=stop_while_writing)
    assert not out.exists() and list(tmp_path.glob(".o.gguf*")) == []
    prune(tiny["llama"], out, cfg, progress=False, cache_dir=cache)
    assert inspect_gguf(out).feed_forward_length == 64


def test_auto_takes_the_torch_path_only_for_what_needs_it():
    from comfyui_a3b.prune.pipeline import choose_calibration

    assert choose_calibration(PruneConfig(keep=0.5, recover_steps=0), "llama") == "llama"
    assert choose_calibration(PruneConfig(keep=0.5, recover_steps=0), "gemma3") == "llama"
    assert choose_calibration(PruneConfig(keep=0.5), "llama") == "torch"              # recovery
    assert choose_calibration(PruneConfig(keep=1.0, heads_keep=0.67), "qwen3") == "torch"  # heads
    assert choose_calibration(PruneConfig(keep=0.5, recover_steps=0, calibration="torch"), "llama") == "torch"


def test_cli_prunes_a_gemma3_file(tiny, tmp_path, capsys):
    from comfyui_a3b.cli import main

    out = tmp_path / "cli.gguf"
    rc = main(["prune", str(tiny["gemma3"]), "--keep", "0.5", "--method", "wanda", "--recover-steps", "0",
               "--calib-windows", "8", "--seq-len", "64", "--out", str(out), "--quiet",
               "--cache-dir", str(tmp_path / "c")])
    assert rc == 0 and inspect_gguf(out).feed_forward_length == 64
    assert "64/128" in capsys.readouterr().out


def test_calib_dir_is_read_recursively(tiny, tmp_path, cache):
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("the a def return x " * 400)
    (d / "sub" / "b.py").write_text("def x():\n    return the\n" * 400)
    (d / ".hidden").write_text("ignored " * 100)
    out = tmp_path / "o.gguf"
    res = prune(tiny["qwen35"], out, PruneConfig(keep=0.5, method="wanda", calib_dirs=(str(d),), **FAST),
                progress=False, cache_dir=cache)
    assert res.metadata["calib.files"] == ["texts/a.txt", "texts/sub/b.py"]
