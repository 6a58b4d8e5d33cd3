"""Statistics from llama.cpp's graph evaluation callback, on tiny GGUFs the tests write (no torch)."""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from tinygguf import write_tiny_gguf

from comfyui_a3b.prune.llama_stats import FFNInputProbe, LlamaCalibrator, PatternProbe

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
