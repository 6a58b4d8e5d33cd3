"""A3B pruning on tiny random GGUFs of each architecture (written by the tests), plus the real
embedded model where it is cheap. Everything runs through real llama.cpp and real torch."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the prune extra (torch) is not installed")

from tinygguf import write_tiny_gguf  # noqa: E402

from comfyui_a3b.runtime import UnsupportedArchitecture, inspect_gguf, sha256_file  # noqa: E402
from comfyui_a3b.runtime.errors import InvalidRequest  # noqa: E402
from comfyui_a3b.prune import (METHODS, CorpusTooSmall, OutputExists, cached_variant,  # noqa: E402
                                       prune)
from comfyui_a3b.runtime.llama.evaluate import LlamaEval  # noqa: E402
from comfyui_a3b.prune.config import PruneConfig  # noqa: E402
from comfyui_a3b.prune.reference import RefModel  # noqa: E402
from comfyui_a3b.prune.source import SourceModel  # noqa: E402

pytestmark = pytest.mark.slow  # torch, calibration and distillation

ARCHS = ("llama", "qwen2", "qwen3")
FAST = dict(calib_windows=8, seq_len=64, recover_seq_len=32, recover_batch=2, gate_windows=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("prune-tiny")
    return {a: write_tiny_gguf(d / f"tiny-{a}.gguf", a, n_ctx=512, n_ff=128, seed=3) for a in ARCHS}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("prune-cache")


def _rand_seq(n_vocab: int, n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, n_vocab, n)]


def _agreement(path: Path, seq: list[int]) -> tuple[float, float]:
    src = SourceModel(path)
    model = RefModel.from_source(src)
    with LlamaEval(path, n_ctx=256) as ev:
        a = ev.logits(seq)
    b = model(torch.tensor(seq))[0].detach().numpy()
    return float((a.argmax(-1) == b.argmax(-1)).mean()), float(np.abs(a - b).max() / np.abs(a).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_forward_matches_llama_cpp(tiny, arch):
    top1, rel = _agreement(tiny[arch], _rand_seq(271, 120))
    assert top1 >= 0.99, f"{arch}: top-1 agreement {top1:.3f}"
    assert rel < 5e-3, f"{arch}: max logit difference {rel:.2e} of the logit range"


@pytest.mark.parametrize("arch", ARCHS)
def test_pruned_file_loads_with_promised_width_and_metadata(tiny, tmp_path, cache, arch):
    out = tmp_path / f"{arch}-pruned.gguf"
    res = prune(tiny[arch], out, PruneConfig(keep=0.5, method="a3b", recover_steps=3, **FAST),
                progress=False, cache_dir=cache)
    assert res.path == out and out.is_file()
    info = inspect_gguf(out)
    assert info.architecture == arch
    assert info.feed_forward_length == 64 == res.n_ff
    src = SourceModel(out)
    for i in range(src.hp.n_layer):
        assert src.weight(f"blk.{i}.ffn_gate.weight").shape == (64, 64)
        assert src.weight(f"blk.{i}.ffn_up.weight").shape == (64, 64)
        assert src.weight(f"blk.{i}.ffn_down.weight").shape == (64, 64)
    a = info.a3b
    assert a["a3b.version"] == 1 and a["a3b.method"] == "a3b"
    assert a["a3b.keep"] == pytest.approx(0.5) and a["a3b.n_ff"] == 64 and a["a3b.n_ff_source"] == 128
    assert a["a3b.source.sha256"] == sha256_file(tiny[arch])
    assert len(a["a3b.calib.digest"]) == 64
    assert "argparse" in a["a3b.calib.code_modules"] and "pickle" in a["a3b.heldout.code_modules"]
    assert not set(a["a3b.calib.prose_topics"]) & set(a["a3b.heldout.prose_topics"])
    assert a["a3b.recover.steps"] == 3
    assert len(a["a3b.gate.thresholds"]) == src.hp.n_layer
    # bias compensation only where llama.cpp reads an ffn_down bias
    assert a["a3b.bias_compensation"] is (arch == "llama")
    # llama.cpp loads it and computes what the reference forward computes for the pruned weights
    top1, rel = _agreement(out, _rand_seq(271, 100, seed=1))
    assert top1 >= 0.99 and rel < 5e-3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_head_pruning_keeps_every_kv_head_and_loads(tiny, tmp_path, cache, arch):
    out = tmp_path / f"{arch}-heads.gguf"
    res = prune(tiny[arch], out, PruneConfig(keep=0.5, heads_keep=0.5, recover_steps=3, **FAST),
                progress=False, cache_dir=cache)
    src = SourceModel(out)
    assert (src.hp.n_head, src.hp.n_head_kv, src.hp.head_dim) == (2, 2, 16)  # source: 4 query, 2 KV heads
    for i in range(src.hp.n_layer):
        assert src.weight(f"blk.{i}.attn_q.weight").shape == (32, 64)
        assert src.weight(f"blk.{i}.attn_k.weight").shape == (32, 64)
        assert src.weight(f"blk.{i}.attn_output.weight").shape == (64, 32)
    a = inspect_gguf(out).a3b
    assert (a["a3b.n_head"], a["a3b.n_head_source"], res.n_ff) == (2, 4, 64)
    assert a["a3b.heads_keep"] == pytest.approx(0.5)
    top1, rel = _agreement(out, _rand_seq(271, 100, seed=1))  # llama.cpp computes what the reference does
    assert top1 >= 0.99 and rel < 5e-3


def test_head_pruning_slices_query_rows_of_the_kept_heads(tiny, tmp_path, cache):
    out = tmp_path / "heads-only.gguf"
    prune(tiny["llama"], out, PruneConfig(keep=1.0, heads_keep=0.5, recover_steps=0, **FAST), progress=False,
          cache_dir=cache)
    a, b = SourceModel(tiny["llama"]), SourceModel(out)
    assert b.hp.n_ff == a.hp.n_ff
    for i in range(a.hp.n_layer):
        q_src, q = a.weight(f"blk.{i}.attn_q.weight"), b.weight(f"blk.{i}.attn_q.weight")
        heads = [h for h in range(4) for j in range(2) if np.array_equal(q[j * 16:(j + 1) * 16],
                                                                         q_src[h * 16:(h + 1) * 16])]
        assert len(heads) == 2 and heads[0] in (0, 1) and heads[1] in (2, 3)  # one per KV group, in order
        np.testing.assert_array_equal(b.weight(f"blk.{i}.attn_k.weight"), a.weight(f"blk.{i}.attn_k.weight"))


def test_head_plan_keeps_the_strongest_head_of_each_group_and_refits():
    from comfyui_a3b.prune.dense.heads import plan_heads, query_rows

    rng = np.random.default_rng(0)
    D, n = 8, 4000
    o = rng.normal(size=(n, 4 * D))
    o[:, D:2 * D] *= 0.01                                                    # group 0: head 1 nearly silent
    o[:, 2 * D:3 * D] = 0.5 * o[:, 3 * D:] + 0.05 * rng.normal(size=(n, D))  # group 1: head 2 echoes head 3
    wo = rng.normal(size=(16, 4 * D))
    plan = plan_heads(wo, o.T @ o / n, 4, 2, D, 1)
    assert list(plan.keep) == [0, 3]
    cols = query_rows(plan.keep, D)
    y = o @ wo.T
    err_refit = np.sum((y - o[:, cols] @ plan.wo.T) ** 2)
    err_drop = np.sum((y - o[:, cols] @ wo[:, cols].T) ** 2)
    assert err_refit < 0.1 * err_drop  # the kept head 3 takes over what its echo added


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_one_reproduces_source_outputs(tiny, tmp_path, cache, arch):
    out = tmp_path / "same.gguf"
    prune(tiny[arch], out, PruneConfig(keep=1.0, method="a3b", recover_steps=50, **FAST), progress=False,
          cache_dir=cache)
    seq = _rand_seq(271, 80, seed=2)
    with LlamaEval(tiny[arch], n_ctx=128) as a, LlamaEval(out, n_ctx=128) as b:
        np.testing.assert_array_equal(a.logits(seq), b.logits(seq))
    assert inspect_gguf(out).feed_forward_length == 128


def test_keep_one_reproduces_the_embedded_model(default_path, tmp_path, cache):
    out = tmp_path / "smol-keep1.gguf"
    prune(default_path, out, PruneConfig(keep=1.0, recover_steps=0, calib_windows=8, seq_len=128, gate_windows=1),
          progress=False, cache_dir=cache)
    with LlamaEval(default_path, n_ctx=128) as a, LlamaEval(out, n_ctx=128) as b:
        seq = a.tokenize("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
        np.testing.assert_array_equal(a.logits(seq), b.logits(seq))
    assert inspect_gguf(out).file_type == "Q4_1"


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_a_loadable_file(tiny, tmp_path, cache, method):
    out = tmp_path / f"{method}.gguf"
    res = prune(tiny["llama"], out, PruneConfig(keep=0.63, method=method, recover_steps=0, align=8, **FAST),
                progress=False, cache_dir=cache)
    assert res.n_ff == 80  # round(0.63 * 128 / 8) * 8
    if method in ("flap", "obs", "a3b"):  # bias compensation (llama)
        assert SourceModel(out).has("blk.0.ffn_down.bias")
    with LlamaEval(out, n_ctx=128) as ev:
        assert np.isfinite(ev.logits(_rand_seq(271, 40))).all()
    assert inspect_gguf(out).a3b["a3b.method"] == method


def test_obs_reconstructs_the_ffn_output_better_than_plain_scores(tiny, cache):
    """The least-squares re-fit: obs's FFN output error on calibration activations is below wanda's."""
    from comfyui_a3b.prune.calibration import reference_stats as calibrate
    from comfyui_a3b.prune.dense import methods
    from comfyui_a3b.prune.corpus import code_corpus, windows

    src = SourceModel(tiny["llama"])
    model = RefModel.from_source(src)
    with LlamaEval(tiny["llama"], n_ctx=128) as ev:
        wins = windows(ev.tokenize, code_corpus("calibration"), 64, 16)
    st = calibrate.collect(model, wins, src.sha256, cache_dir=None, progress=False).layers[0]
    down = src.weight("blk.0.ffn_down.weight").astype(np.float64)
    rng = np.random.default_rng(0)
    G = st.gram

    def err(keep, new_down, bias=None):
        D = np.zeros_like(down)
        D[:, keep] = new_down
        E = down - D
        e = np.trace(E @ G @ E.T)
        if bias is not None:  # the bias adds b to every token's output
            e += -2 * bias @ (E @ st.sum) + st.count * bias @ bias
        return e

    wa = methods.plan_layer("wanda", src.weight("blk.0.ffn_gate.weight"), src.weight("blk.0.ffn_up.weight"),
                            down, None, st, 64, rng, bias_ok=False)
    a3 = methods.plan_layer("obs", src.weight("blk.0.ffn_gate.weight"), src.weight("blk.0.ffn_up.weight"),
                            down, None, st, 64, rng, bias_ok=False)
    assert err(a3.keep, a3.down) < 0.8 * err(wa.keep, down[:, wa.keep])


def _kl(teacher, student, seqs) -> float:
    F = torch.nn.functional
    x = torch.tensor(seqs)
    with torch.no_grad():
        t, s = F.log_softmax(teacher(x), -1), F.log_softmax(student(x), -1)
    return float(F.kl_div(s.flatten(0, 1), t.flatten(0, 1), log_target=True, reduction="batchmean"))


def _half_width_student(src: SourceModel) -> RefModel:
    w = {n: np.array(src.weight(n), copy=True) for n in src.tensors}
    for i in range(src.hp.n_layer):
        p = f"blk.{i}."
        w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"] = w[p + "ffn_gate.weight"][::2], w[p + "ffn_up.weight"][::2]
        w[p + "ffn_down.weight"] = np.ascontiguousarray(w[p + "ffn_down.weight"][:, ::2])
    return RefModel(src.hp, w)


@pytest.mark.parametrize("train", ["ffn", "all"])
def test_distillation_lowers_the_kl(tiny, train):
    """Mechanics on a random tiny model (random text carries nothing to generalise from, so the KL
    is measured on the training windows; the bench measures held-out quality on the real model)."""
    from comfyui_a3b.prune.dense import distill

    src = SourceModel(tiny["qwen3"])
    teacher, student = RefModel.from_source(src), _half_width_student(src)
    held = [_rand_seq(271, 48, seed=s) for s in range(8)]
    train_w = [np.array(held)]
    before = _kl(teacher, student, held)
    rep = distill.distill(student, teacher, train_w, 40, lr=3e-3, batch=4, train=train, progress=False)
    after = _kl(teacher, student, held)
    assert len(rep.losses) == 40 and rep.tokens == 40 * 4 * 48
    assert after < 0.7 * before, (before, after)
    attn = [n for n in rep.trained if ".attn_" in n]
    assert bool(attn) == (train == "all")
    # the teacher's tensors are its own: training the student never moves them
    assert torch.equal(teacher.layers[0].wq, torch.from_numpy(src.weight("blk.0.attn_q.weight")))


def test_recovery_batches_follow_their_shares():
    from comfyui_a3b.prune.dense.distill import Batches

    code, prose = np.zeros((10, 4), dtype=np.int32), np.ones((3, 4), dtype=np.int32)
    even = Batches([code, prose], 4, seed=0).next()
    assert [int(r[0]) for r in even] == [0, 1, 0, 1]
    b = Batches([code, prose], 8, seed=0, shares=[0.75, 0.25])
    rows = np.concatenate([b.next() for _ in range(5)])
    assert (rows[:, 0] == 0).mean() == pytest.approx(0.75)
    with pytest.raises(InvalidRequest, match="code share"):
        PruneConfig(recover_code_share=1.0).validate()


def test_distillation_resumes_from_its_checkpoint(tiny, tmp_path):
    from comfyui_a3b.prune.dense import distill

    src = SourceModel(tiny["llama"])
    teacher = RefModel.from_source(src)
    train_w = [np.array([_rand_seq(271, 32, seed=s) for s in range(16)]),
               np.array([_rand_seq(271, 32, seed=50 + s) for s in range(8)])]
    ref = _half_width_student(src)
    distill.distill(ref, teacher, train_w, 12, batch=2, progress=False)
    ck = tmp_path / "ck.pt"
    calls = {"n": 0}

    def stop_after_7():
        calls["n"] += 1
        return calls["n"] > 7

    cut = _half_width_student(src)
    rep1 = distill.distill(cut, teacher, train_w, 12, batch=2, progress=False, checkpoint=ck, checkpoint_every=1,
                           should_stop=stop_after_7)
    assert len(rep1.losses) == 7 and ck.is_file()
    again = _half_width_student(src)
    rep2 = distill.distill(again, teacher, train_w, 12, batch=2, progress=False, checkpoint=ck, checkpoint_every=1)
    assert rep2.resumed_at == 7 and len(rep2.losses) == 12
    for a, b in zip(ref.parameters(), again.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_dynamic_gate_hits_its_sparsity_and_is_exact_at_zero(tiny):
    from comfyui_a3b.prune.dense import gate
    from comfyui_a3b.prune.reference import perplexity

    src = SourceModel(tiny["llama"])
    model = RefModel.from_source(src)
    seqs = [_rand_seq(271, 64, seed=s) for s in range(4)]
    th = gate.calibrate_thresholds(model, np.array(seqs), 0.6)
    counter: dict = {}
    p_gated = perplexity(model, seqs, gate.gate_hook(th, counter))
    assert counter["off"] / counter["all"] == pytest.approx(0.6, abs=0.03)
    assert perplexity(model, seqs, gate.gate_hook([0.0] * len(th))) == pytest.approx(perplexity(model, seqs))
    assert p_gated != pytest.approx(perplexity(model, seqs), rel=1e-6)


# -- bad input ------------------------------------------------------------------------------------

def test_unsupported_architecture_is_named(tmp_path):
    p = write_tiny_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(UnsupportedArchitecture, match="'gpt2'"):
        prune(p, tmp_path / "out.gguf", PruneConfig(**FAST), progress=False)
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("keep", [0.0, -0.2, 1.01, 5, float("nan")])
def test_keep_ratio_outside_unit_interval(tiny, tmp_path, keep):
    with pytest.raises(InvalidRequest, match=r"keep ratio must be in \(0, 1\]"):
        prune(tiny["llama"], tmp_path / "o.gguf", PruneConfig(keep=keep, **FAST), progress=False)


def test_existing_output_is_refused_unless_forced(tiny, tmp_path, cache):
    out = tmp_path / "exists.gguf"
    out.write_bytes(b"precious")
    with pytest.raises(OutputExists, match="--force"):
        prune(tiny["llama"], out, PruneConfig(keep=0.5, recover_steps=0, **FAST), progress=False, cache_dir=cache)
    assert out.read_bytes() == b"precious"
    prune(tiny["llama"], out, PruneConfig(keep=0.5, recover_steps=0, **FAST), force=True, progress=False,
          cache_dir=cache)
    assert inspect_gguf(out).feed_forward_length == 64


def test_calibration_corpus_too_small(tiny, tmp_path):
    f = tmp_path / "small.txt"
    f.write_text("def f(x):\n    return x + 1\n")
    with pytest.raises(CorpusTooSmall, match="windows"):
        prune(tiny["llama"], tmp_path / "o.gguf", PruneConfig(calib_files=(str(f),), **FAST), progress=False)
    # enough windows but too few tokens for a3b's covariance of 128 neurons
    with pytest.raises(CorpusTooSmall, match="covariance"):
        prune(tiny["llama"], tmp_path / "o.gguf", PruneConfig(method="a3b", calib_windows=2, seq_len=64),
              progress=False)
    assert not (tmp_path / "o.gguf").exists()


def test_recovery_text_too_small_is_refused_before_any_work(tiny, tmp_path):
    f = tmp_path / "some.txt"
    f.write_text("def f(x):\n    return x + 1\n" * 40)
    cfg = PruneConfig(keep=0.5, method="wanda", recover_steps=5, calib_files=(str(f),), calib_windows=4, seq_len=16,
                      recover_seq_len=100000)
    with pytest.raises(CorpusTooSmall, match="for recovery"):
        prune(tiny["llama"], tmp_path / "o.gguf", cfg, progress=False, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("heads_keep", [0.0, -1.0, 1.5])
def test_heads_keep_outside_unit_interval(heads_keep):
    with pytest.raises(InvalidRequest, match=r"heads keep ratio must be in \(0, 1\]"):
        PruneConfig(heads_keep=heads_keep).validate()


def test_head_pruning_refused_where_llama_cpp_could_not_load_it(tiny, tmp_path):
    with pytest.raises(InvalidRequest, match="'qwen2'"):  # llama.cpp expects an n_embd x n_embd attn_q
        prune(tiny["qwen2"], tmp_path / "o.gguf", PruneConfig(heads_keep=0.5, **FAST), progress=False)
    with pytest.raises(CorpusTooSmall, match="head pruning .*covariance"):  # 64 x 64 needs 128 tokens
        prune(tiny["llama"], tmp_path / "o.gguf", PruneConfig(keep=1.0, heads_keep=0.5, calib_windows=1, seq_len=64),
              progress=False)
    mha = write_tiny_gguf(tmp_path / "mha.gguf", "llama", n_head=4, n_head_kv=4, n_ff=128, seed=3)
    with pytest.raises(InvalidRequest, match="nothing to remove"):  # one query head per KV head
        prune(mha, tmp_path / "o.gguf", PruneConfig(heads_keep=0.5, **FAST), progress=False)
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("bad, match", [(dict(recover_train="attention"), "'all' or 'ffn'"),
                                        (dict(recover_batch=0), "at least 1 window"),
                                        (dict(recover_code_share=0.0), "code share")])
def test_bad_recovery_settings(bad, match):
    with pytest.raises(InvalidRequest, match=match):
        PruneConfig(**bad).validate()


def test_interrupt_inside_the_run_leaves_no_output(tiny, tmp_path, cache):
    out = tmp_path / "interrupted.gguf"
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return False

    with pytest.raises(KeyboardInterrupt):
        prune(tiny["llama"], out, PruneConfig(keep=0.5, recover_steps=20, **FAST), progress=False, cache_dir=cache,
              should_stop=stop)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_cli_sigint_exits_130_and_leaves_no_output(tiny, tmp_path):
    out = tmp_path / "cli.gguf"
    env = dict(os.environ, A3B_CACHE=str(tmp_path / "cache"))
    p = subprocess.Popen([sys.executable, "-m", "comfyui_a3b.cli", "prune", str(tiny["llama"]), "--keep", "0.5",
                          "--recover-steps", "100000", "--calib-windows", "8", "--seq-len", "64", "--out", str(out)],
                         stderr=subprocess.PIPE, text=True, env=env,
                         # a test run started in the background inherits SIGINT ignored; a terminal's
                         # Ctrl-C is what this test is about, so give the child the default disposition
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = ""
    deadline = time.time() + 120
    while "distilling" not in seen and time.time() < deadline:
        seen += p.stderr.read(1)
    p.send_signal(signal.SIGINT)
    rest = p.communicate(timeout=60)[1]
    assert p.returncode == 130, seen + rest
    assert "interrupted" in rest
    assert not out.exists() and not [x for x in tmp_path.iterdir() if x.name.startswith(".cli.gguf")]


def test_cli_reports_bad_input_in_one_line(tiny, tmp_path):
    from comfyui_a3b import cli

    assert cli.main(["prune", str(tiny["llama"]), "--keep", "0", "--out", str(tmp_path / "x.gguf")]) == 2
    assert cli.main(["prune", str(tmp_path / "missing.gguf")]) == 2


def test_cli_writes_a_pruned_file(tiny, tmp_path, capsys):
    from comfyui_a3b import cli

    out = tmp_path / "cli-ok.gguf"
    rc = cli.main(["prune", str(tiny["qwen2"]), "--keep", "0.75", "--method", "flap", "--recover-steps", "2",
                   "--calib-windows", "8", "--seq-len", "64", "--out", str(out), "--quiet",
                   "--cache-dir", str(tmp_path / "c")])
    assert rc == 0 and "FFN width 96/128" in capsys.readouterr().out
    assert inspect_gguf(out).a3b["a3b.method"] == "flap"


def test_cached_variant_is_made_once(tiny, tmp_path):
    kw = dict(cache_dir=tmp_path, recover_steps=2, **FAST)
    p1 = cached_variant(tiny["qwen3"], keep=0.5, method="wanda", **kw)
    assert p1.is_file() and p1.parent == tmp_path / "variants"
    mtime = p1.stat().st_mtime_ns
    t0 = time.perf_counter()
    p2 = cached_variant(tiny["qwen3"], keep=0.5, method="wanda", **kw)
    assert p2 == p1 and p2.stat().st_mtime_ns == mtime and time.perf_counter() - t0 < 1.0
    p3 = cached_variant(tiny["qwen3"], keep=0.75, method="wanda", **kw)
    assert p3 != p1 and inspect_gguf(p3).feed_forward_length == 96
    assert sha256_file(tiny["qwen3"])[:12] in p1.name
    assert not [x for x in (tmp_path / "variants").iterdir() if ".part" in x.name]
    with pytest.raises(InvalidRequest, match="unknown pruning settings"):
        cached_variant(tiny["qwen3"], keep=0.5, cache_dir=tmp_path, bogus=1)


def test_package_imports_without_torch_and_names_the_extra(tiny, tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "import comfyui_a3b.prune as p\n"
            "from comfyui_a3b import cli\n"
            f"sys.exit(cli.main(['prune', {str(tiny['llama'])!r}, '--out', {str(tmp_path / 'x.gguf')!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "pip install 'comfyui-a3b[prune]'" in r.stderr
