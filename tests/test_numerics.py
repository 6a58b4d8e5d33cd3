"""The reference forward's emulation of llama.cpp's CPU activation rounding (prune/numerics.py),
checked against the installed llama.cpp: its own quantisation and dot-product kernels (through the
public `ggml_get_type_traits_cpu` of the ggml CPU library), tiny float models, and the embedded model."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the prune extra (torch) is not installed")

from tinygguf import write_tiny_gguf  # noqa: E402

from comfyui_a3b.prune import corpus, numerics  # noqa: E402
from comfyui_a3b.runtime.llama.evaluate import LlamaEval  # noqa: E402
from comfyui_a3b.prune.reference import RefModel  # noqa: E402
from comfyui_a3b.prune.source import SourceModel  # noqa: E402

pytestmark = pytest.mark.slow  # torch and the real embedded model

F = torch.nn.functional


class _TraitsCpu(ctypes.Structure):  # struct ggml_type_traits_cpu (ggml-cpu.h)
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


@pytest.fixture(scope="module")
def ggml_cpu():
    import llama_cpp

    from comfyui_a3b.runtime.llama import llama

    llama()  # loads and initialises the backends
    libdir = Path(llama_cpp.__file__).resolve().parent / "lib"
    libs = [p for pat in ("libggml-cpu*.so*", "libggml-cpu*.dylib", "ggml-cpu*.dll") for p in sorted(libdir.glob(pat))]
    if not libs:
        pytest.skip("llama-cpp-python ships no separate ggml CPU library here")
    lib = ctypes.CDLL(str(libs[0]))
    lib.ggml_cpu_init()  # its conversion tables, in case this is a second copy of the library
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TraitsCpu)
    lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    lib.ggml_blck_size.restype = ctypes.c_int64
    lib.ggml_type_size.restype = ctypes.c_size_t
    lib.ggml_blck_size.argtypes = lib.ggml_type_size.argtypes = [ctypes.c_int]
    return lib


def _type(name: str) -> int:
    from gguf.constants import GGMLQuantizationType

    return int(GGMLQuantizationType[name])


def _from_float(lib, type_name: str, x: np.ndarray) -> np.ndarray:
    """llama.cpp's own conversion of one float32 row to `type_name`, as raw blocks (uint8, per block).
    Block sizes come from the library (gguf-py's table still has Q8_1's older 40-byte layout)."""
    tid = _type(type_name)
    block, size = int(lib.ggml_blck_size(tid)), int(lib.ggml_type_size(tid))
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(x.size // block * size, dtype=np.uint8)
    _FROM_FLOAT(lib.ggml_get_type_traits_cpu(tid).contents.from_float)(x.ctypes.data, out.ctypes.data, x.size)
    return out.reshape(-1, size)


def _activations(n: int, seed: int) -> np.ndarray:
    """Activation-like rows: mostly small values, a few outliers, an all-zero block, exact ties."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((4, n)) * 0.3).astype(np.float32)
    x[:, rng.integers(0, n, 6)] *= 40
    x[1, :256] = 0.0
    x[2, :32] = np.arange(32) - 16 + 0.5  # amax 15.5: not a tie after scaling
    x[3, :32] = np.concatenate([[127.0], np.arange(31) - 15 + 0.5])  # amax 127: x*127/amax = x, halves are ties
    x[3, 256:512] = np.concatenate([[127.0], np.arange(255) / 2 - 63.5])  # Q8_K: iscale = -1, ties too
    return x


def test_vec_dot_types_follow_llama_cpp(ggml_cpu):
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL", "IQ4_XS", "F16", "BF16", "F32"):
        got = ggml_cpu.ggml_get_type_traits_cpu(_type(name)).contents.vec_dot_type
        assert got == _type(numerics.vec_dot_type(name)), name


@pytest.mark.parametrize("kind", ["Q8_0", "Q8_1", "Q8_K"])
def test_activation_quantisation_is_llama_cpps(ggml_cpu, kind):
    for row in _activations(1024, seed=1):
        raw = _from_float(ggml_cpu, kind, row)
        if kind == "Q8_K":
            d = raw[:, 0:4].copy().view(np.float32)[:, 0]
            q = raw[:, 4:260].view(np.int8).astype(np.float32)
            want = (d[:, None] * q).reshape(-1)
            got = numerics.quantize_q8_K(torch.from_numpy(row)).numpy()
        else:
            d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
            q = raw[:, -32:].view(np.int8).astype(np.float32)
            want = (d[:, None] * q).reshape(-1)
            if kind == "Q8_0":
                got = numerics.quantize_q8_0(torch.from_numpy(row)).numpy()
            else:
                got_t, s_err = numerics.quantize_q8_1(torch.from_numpy(row))
                got = got_t.numpy()
                s = raw[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
                np.testing.assert_array_equal(s_err.numpy() + d * q.sum(-1), s)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_float_activation_rounding_is_llama_cpps(ggml_cpu, kind):
    row = _activations(1024, seed=2)[0]
    raw = _from_float(ggml_cpu, kind, row).reshape(-1).copy().view(np.uint16)
    if kind == "F16":
        want = raw.view(np.float16).astype(np.float32)
    else:
        want = (raw.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(numerics.round_activations(torch.from_numpy(row), kind).numpy(), want)


@pytest.mark.parametrize("tensor", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"])
def test_emulated_product_is_llama_cpps_kernel(ggml_cpu, default_path, tensor):
    """On real weights of the embedded model (Q4_1 and Q8_0), the emulated product equals llama.cpp's
    quantise-then-dot result up to float summation order; the plain float product does not."""
    src = SourceModel(default_path)
    t = src.tensors[tensor]
    rows = 512
    raw = np.ascontiguousarray(np.asarray(t.data)[:rows])
    w = torch.from_numpy(src.weight(tensor)[:rows])
    offsets = numerics.block_offsets(t)  # Q4_1: per-block m; Q8_0: None
    lin = numerics.EmulatedLinear(t.tensor_type.name, None if offsets is None else offsets[:rows])
    traits = ggml_cpu.ggml_get_type_traits_cpu(_type(t.tensor_type.name)).contents
    dot = _VEC_DOT(traits.vec_dot)
    n = w.shape[1]
    acts = _activations(n, seed=3)
    s = ctypes.c_float()
    for x in acts:
        qx = _from_float(ggml_cpu, numerics.vec_dot_type(t.tensor_type.name), x)
        want = np.empty(rows, dtype=np.float32)
        for i in range(rows):
            dot(n, ctypes.addressof(s), 0, raw[i].ctypes.data, 0, qx.ctypes.data, 0, 1)
            want[i] = s.value
        scale = np.abs(want).max()
        got = lin(torch.from_numpy(x)[None], w)[0].numpy()
        plain = F.linear(torch.from_numpy(x)[None], w)[0].numpy()
        assert np.abs(got - want).max() <= 2e-6 * scale, tensor
        assert np.abs(plain - want).max() > 1e-4 * scale, tensor


def test_plain_reference_is_unchanged_and_trainable(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", n_ff=128, seed=5)
    src = SourceModel(path)
    model = RefModel.from_source(src)
    assert model.emulate is None and all(layer.emu is None for layer in model.layers)
    for p in model.ffn_parameters():
        p.requires_grad_(True)
    model(torch.tensor([1, 5, 9, 14, 3]))[0].logsumexp(-1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.ffn_parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_emulation_brings_float_models_closer_to_llama_cpp(tmp_path, arch, dtype):
    """F16 weights: activations rounded to fp16; F32: only the F16 KV cache. Both are deterministic
    enough that the emulated forward lands closer to llama.cpp than the plain one."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch, n_ctx=512, n_ff=128, seed=3, dtype=dtype)
    src = SourceModel(path)
    weights = {n: src.weight(n) for n in src.tensors}
    plain = RefModel(src.hp, weights)
    emu = RefModel(src.hp, weights, numerics.Emulation.from_source(src))
    seq = [int(x) for x in np.random.default_rng(0).integers(3, 271, 120)]
    with LlamaEval(path, n_ctx=256) as ev:
        a = ev.logits(seq)
    with torch.no_grad():
        p = plain(torch.tensor(seq))[0].numpy()
        e = emu(torch.tensor(seq))[0].numpy()
    assert (a.argmax(-1) == e.argmax(-1)).mean() >= 0.99
    assert np.abs(a - e).max() < np.abs(a - p).max()


def test_reference_is_as_close_to_llama_cpp_as_llama_cpp_is_to_itself(default_path):
    """On the quantised embedded model, top-1 agreement with llama.cpp's batched logits is about 96%,
    not the 99% aimed for, because 8-bit activation rounding makes the forward chaotic (docs/pruning.md).
    llama.cpp decoding the same text token by token agrees with its own batched logits no better, so
    the reference is held to that: within 3 points of llama.cpp's self-agreement."""
    src = SourceModel(default_path)
    plain = RefModel.from_source(src)
    ref, own = [], []
    with LlamaEval(default_path, n_ctx=256) as ev:
        held = corpus.corpora("heldout")
        windows = [corpus.windows(ev.tokenize, held[k], 256, 1, ev.bos)[0] for k in ("code", "prose")]
        for w in windows:
            a = ev.logits(w).argmax(-1)
            own.append(float((ev.logits_stepwise(w).argmax(-1) == a).mean()))
            with torch.no_grad():
                ref.append(float((plain(torch.tensor(w))[0].numpy().argmax(-1) == a).mean()))
    ref_top1, own_top1 = float(np.mean(ref)), float(np.mean(own))
    assert ref_top1 >= own_top1 - 0.03, f"reference {ref_top1:.3f}, llama.cpp token by token {own_top1:.3f}"
    assert ref_top1 >= 0.93
