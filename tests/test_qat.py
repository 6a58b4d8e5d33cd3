"""Quantisation-aware recovery emulates llama.cpp's own quantiser exactly (real llama_model_quantize)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the prune extra (torch) is not installed")

from tinygguf import write_tiny_gguf  # noqa: E402

from comfyui_a3b.prune.dense import qat  # noqa: E402
from comfyui_a3b.prune.source import SourceModel  # noqa: E402
from comfyui_a3b.runtime.llama.quantize import quantize_file as quantize  # noqa: E402

pytestmark = pytest.mark.slow  # torch and llama.cpp's quantiser

# llama.h's LLAMA_FTYPE_MOSTLY_* values
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "F16": 1}


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("qat") / "tiny.gguf", "llama", n_ff=128, seed=5)


@pytest.mark.parametrize("qtype", list(FTYPES))
def test_round_like_is_what_llama_cpp_stores(f32_model, tmp_path, qtype):
    out = tmp_path / f"{qtype}.gguf"
    quantize(f32_model, out, FTYPES[qtype])
    src, q = SourceModel(f32_model), SourceModel(out)
    checked = 0
    for name, t in q.tensors.items():
        if t.tensor_type.name != qtype:
            continue  # llama.cpp keeps norms in F32 and may pick another type for some tensors
        w = torch.from_numpy(src.weight(name))
        assert torch.equal(qat.round_like(w, qtype), torch.from_numpy(q.weight(name))), name
        checked += 1
    assert checked >= 14  # every FFN and attention matrix of both layers


def test_rounded_weights_survive_a_second_quantisation(tmp_path):
    """What training exports (rounded values) is stored unchanged: quantising it again is exact."""
    w = torch.randn(8, 96) * 0.05
    w[0, 5] = 0.9  # an outlier block
    for qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        r = qat.round_like(w, qtype)
        assert torch.equal(qat.round_like(r, qtype), r), qtype
        assert (r - w).abs().max() < 0.07, qtype


def test_fake_quant_passes_gradients_straight_through():
    gen = torch.Generator().manual_seed(0)
    fq = qat.FakeQuant("Q4_1")
    for _ in range(20):  # the forward value is the grid value exactly, not one ulp off
        w = torch.randn(16, 256, generator=gen)
        assert torch.equal(fq(w), qat.round_like(w, "Q4_1"))
    w = torch.randn(4, 64, requires_grad=True)
    y = fq(w)
    assert torch.equal(y.detach(), qat.round_like(w.detach(), "Q4_1"))
    y.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_unsupported_type_is_refused():
    with pytest.raises(ValueError, match="Q4_K"):
        qat.round_like(torch.zeros(2, 256), "Q4_K")
    assert not qat.emulated("Q4_K") and qat.emulated("Q4_1")
