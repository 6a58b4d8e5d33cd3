"""Which FFN layouts streamed pruning accepts, as pure logic over tensor names and shapes."""
from __future__ import annotations

import pytest

from comfyui_a3b.prune.layout import check_layout
from comfyui_a3b.runtime.errors import UnsupportedArchitecture


def _shapes(n_layer=2, n_ff=8, n_embd=4, gate=True, extra=()):
    s = {}
    for i in range(n_layer):
        p = f"blk.{i}."
        s[p + "ffn_up.weight"] = (n_ff, n_embd)
        s[p + "ffn_down.weight"] = (n_embd, n_ff)
        s[p + "ffn_norm.weight"] = (n_embd,)
        if gate:
            s[p + "ffn_gate.weight"] = (n_ff, n_embd)
    for name, shape in extra:
        s[name] = shape
    return s


def check(arch="gemma3", shapes=None, n_layer=2, ffl=8):
    shapes = shapes or _shapes(n_layer)
    return check_layout(arch, list(shapes), shapes, n_layer, ffl, "m.gguf")


def test_gated_and_ungated_ffns_are_accepted():
    lay = check()
    assert (lay.n_ff, lay.gated, lay.down_bias_ok) == (8, True, False)
    assert not check("qwen35", _shapes(gate=False)).gated
    assert check("llama").down_bias_ok
    assert check("qwen3", ffl=[8, 8]).n_ff == 8  # one width written per layer is still one width


@pytest.mark.parametrize("case, match", [
    (dict(arch="phi3"), "'phi3'.*FFN layout"),
    (dict(ffl=[8, 6]), "differ per layer"),
    (dict(ffl=None), "feed_forward_length"),
    (dict(shapes=_shapes(extra=[("blk.0.ffn_gate_inp.weight", (4, 4)), ("blk.0.ffn_up_exps.weight", (4, 8, 4))])),
     "mixture-of-experts"),
    (dict(shapes=_shapes(extra=[("blk.1.ffn_gate_up.weight", (16, 4))])), "ffn_gate_up.*does not know"),
    (dict(shapes={**_shapes(), "blk.1.ffn_up.weight": (6, 4)}), "6 rows"),
    (dict(shapes={k: v for k, v in _shapes().items() if k != "blk.1.ffn_gate.weight"}), "some layers"),
    (dict(shapes={k: v for k, v in _shapes().items() if k != "blk.0.ffn_down.weight"}), "no blk.0.ffn_down"),
])
def test_what_cannot_be_narrowed_is_refused_by_name(case, match):
    with pytest.raises(UnsupportedArchitecture, match=match):
        check(**case)
