"""Statistics from llama.cpp's graph evaluation callback, on tiny GGUFs the tests write (no torch)."""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from tinygguf import write_tiny_gguf

from comfyui_a3b.prune.calibration.llama_stats import FFNInputProbe, LlamaCalibrator, PatternProbe

WINDOW = [1] + list(range(5, 40))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("stats") / "moe.gguf", "qwen3moe", n_ctx=128, seed=1)


def test_pattern_probes_read_router_choices_and_node_outputs_in_one_pass(moe):
    got = defaultdict(list)
    probes = [
        PatternProbe(r"blk\.(\d+)\.ffn_gate_inp\.weight", lambda k, n: got["logits", k].append(n.numpy()),
                     ops={"MUL_MAT"}),
        PatternProbe(r"blk\.(\d+)\.ffn_down_exps\.weight", lambda k, n: got["ids", k].append(n.src(2).numpy()),
                     ops={"MUL_MAT_ID"}),
        PatternProbe(r"ffn_moe_probs-(\d+)", lambda k, n: got["probs", k].append(n.numpy()), weight=False),
    ]
    with LlamaCalibrator(moe, 64, n_threads=1) as cal:
        cal.run(probes, [WINDOW, WINDOW[:20]])
    for layer in (0, 1):
        assert [x.shape for x in got["logits", layer]] == [(1, 1, 36, 4), (1, 1, 20, 4)]
        probs, ids = got["probs", layer][0][0, 0], got["ids", layer][0][0, 0]
        assert ids.dtype == np.int32 and ids.shape == (36, 2)  # a strided view of the sorted experts
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
        logits = got["logits", layer][0][0, 0]
        np.testing.assert_allclose(probs, np.exp(logits) / np.exp(logits).sum(-1, keepdims=True), rtol=1e-4)
        # the experts llama.cpp chose are the two most probable
        assert (np.sort(ids, -1) == np.sort(np.argsort(-probs, -1, kind="stable")[:, :2], -1)).all()


def test_a_pass_stops_after_the_last_layer_it_needs(tmp_path):
    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama", n_layer=3, n_ctx=128)
    seen = []
    probe = FFNInputProbe(3, layers=[0])
    spy = PatternProbe(r"blk\.(\d+)\.ffn_down\.weight", lambda k, n: seen.append(k), ops={"MUL_MAT"}, last=0)
    with LlamaCalibrator(path, 64, n_threads=1) as cal:
        cal.run([probe, spy], [WINDOW])
    assert seen == [0] and cal._stopped
    st = probe.layer_stats(0)
    assert st.count == len(WINDOW) and st.sum.shape == (128,) and st.gram is None
    assert (np.abs(st.sum) <= st.sumabs + 1e-9).all() and (st.sumsq > 0).all()


@pytest.mark.parametrize("arch,weighted", [("llama", False), ("gemma3", True)])
def test_a_spilled_layer_gives_the_same_gram_matrix_as_one_held_in_memory(tmp_path, arch, weighted):
    """A layer whose inputs go through a file during the pass gets exactly the matrix it would have had."""
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, n_layer=3, n_ctx=128)
    held = FFNInputProbe(3, gram_layers=range(3), weighted=weighted)
    spilled = FFNInputProbe(3, gram_layers=range(3), weighted=weighted, spill_dir=tmp_path, spill_layers=[1, 2])
    with LlamaCalibrator(path, 64, n_threads=1) as cal:
        cal.run([held, spilled], [WINDOW, WINDOW[:20], WINDOW[3:]])
    assert spilled.acc[1].gram is None and sorted(p.name for p in tmp_path.glob("layer*")) == (
        ["layer0001.w", "layer0001.x", "layer0002.w", "layer0002.x"] if weighted else ["layer0001.x", "layer0002.x"])
    for il in range(3):
        a, b = held.take(il), spilled.take(il)
        assert np.array_equal(a.gram, b.gram) and np.array_equal(a.sumsq, b.sumsq) and a.count == b.count
        assert (a.gram_count, a.gram_sum is None) == (b.gram_count, b.gram_sum is None)
        assert il not in spilled.acc  # taken: its matrix is not kept
    assert list(tmp_path.glob("layer*")) == []
