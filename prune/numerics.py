"""llama.cpp's CPU activation rounding, emulated in torch (opt-in for the reference forward).

llama.cpp's CPU backend does not multiply float activations by quantised weights. In
`ggml_compute_forward_mul_mat` (ggml/src/ggml-cpu/ggml-cpu.c) every row of the activation matrix is
first converted to the weight type's `vec_dot_type` (the `type_traits_cpu` table in the same file)
with that type's `from_float`, and the dot product then runs on the two quantised operands:

    Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4 weights   -> Q8_0 activations (blocks of 32, fp16 scale)
    Q4_1, Q5_1 weights                        -> Q8_1 activations (blocks of 32, fp16 scale and sum)
    K-quants, IQ1/IQ2/IQ3/IQ4_XS, TQ1_0/TQ2_0 -> Q8_K activations (blocks of 256, float scale)
    F16 weights                               -> F16 activations
    BF16 weights                              -> BF16 activations
    F32 weights                               -> F32 (no rounding)

The functions here return the values the dot product effectively sees (scale times integer), so a
float matrix product with the dequantised weights reproduces llama.cpp's result up to float32
summation order. They follow the x86 SIMD code path (AVX/AVX2, which AVX-512 builds also take):
`quantize_row_q8_0` and `quantize_row_q8_1` in ggml/src/ggml-cpu/arch/x86/quants.c compute
`id = 127 / amax` and round `x * id` to nearest with ties to even (`_mm256_round_ps`), while the
portable C fallbacks (`quantize_row_q8_0_ref`, `quantize_row_q8_1_ref` in ggml/src/ggml-quants.c)
use `id = 1 / d` and `roundf` (ties away from zero); the two differ only on values within a
rounding error of a half-integer.

Attention: the KV cache is F16 by default (`type_k`/`type_v` of `llama_context_default_params`),
so K (after RoPE) and V are stored rounded to fp16. What happens to the other operand depends on
the attention kernel, see `attention`.

Each emulated product matches llama.cpp's kernel up to float32 summation order (on the embedded
model's layer 0, fed llama.cpp's own inputs: largest difference 4e-7 of the output range, against
4e-3 without the rounding). End to end it does not make the
reference's logits match llama.cpp's on quantised files: with 8-bit activations a difference in
the last bit of any value (summation order, exp/sqrt approximations) occasionally moves a value
across a rounding boundary, a whole quantisation step, and such steps spread through attention to
every later position. llama.cpp itself disagrees with itself at the same level between its batched
and token-by-token attention kernels; docs/pruning.md has the measurements.

Nothing here is differentiable in a useful way (rounding has zero gradient almost everywhere); it
is for checking numbers against llama.cpp, not for training.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .errors import require_torch

torch = require_torch()
F = torch.nn.functional

QK8_0 = QK8_1 = 32
QK_K = 256

_Q8_0 = ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4")
_Q8_1 = ("Q4_1", "Q5_1")
_Q8_K = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
         "IQ1_S", "IQ1_M", "IQ4_XS", "TQ1_0", "TQ2_0")


def vec_dot_type(weight_type: str) -> str:
    """The type llama.cpp's CPU backend converts activations to before multiplying by `weight_type`.

    From `type_traits_cpu[...].vec_dot_type` in ggml/src/ggml-cpu/ggml-cpu.c.
    """
    t = weight_type.upper()
    if t in _Q8_0:
        return "Q8_0"
    if t in _Q8_1:
        return "Q8_1"
    if t in _Q8_K:
        return "Q8_K"
    if t in ("F16", "BF16", "F32"):
        return t
    raise ValueError(f"no llama.cpp CPU activation type known for weights of type {weight_type!r}")


def _blocks(x, size: int):
    if x.shape[-1] % size:
        raise ValueError(f"row length {x.shape[-1]} is not a multiple of the block size {size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def round_f16(x):
    """fp32 -> fp16 -> fp32, round to nearest even (F16C `_mm256_cvtps_ph` / `ggml_cpu_fp32_to_fp16`)."""
    return x.to(torch.float16).to(x.dtype)


def round_bf16(x):
    """fp32 -> bf16 -> fp32, round to nearest even (`ggml_cpu_fp32_to_bf16`)."""
    return x.to(torch.bfloat16).to(x.dtype)


def _rdiv(c: float, t):
    """c / t elementwise with one IEEE division, as C computes it. (`c / t` for a Python number c is
    computed by torch as reciprocal(t) * c, which rounds twice and changes some quantised values.)"""
    nz = t != 0
    return torch.where(nz, torch.full_like(t, c) / torch.where(nz, t, torch.ones_like(t)), torch.zeros_like(t))


def _q8_32(x):
    """Shared part of Q8_0 / Q8_1: per block of 32, d = amax/127, q = round_even(x * (127/amax))."""
    xb = _blocks(x.float(), QK8_0)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / torch.full_like(amax, 127.0)
    inv = _rdiv(127.0, amax)  # 0 for an all-zero block, like the C code
    q = torch.round(xb * inv)  # torch.round: ties to even, like _mm256_round_ps(_MM_ROUND_NEAREST)
    return d, q


def quantize_q8_0(x):
    """The values a Q8_0 activation row stands for: fp16(d) * q per block of 32.

    `quantize_row_q8_0` (ggml/src/ggml-cpu/arch/x86/quants.c): d = amax / 127 stored as fp16
    (`y[i].d = GGML_CPU_FP32_TO_FP16(d)`), q = round(x * 127/amax); the dot products
    (`ggml_vec_dot_q4_0_q8_0`, `ggml_vec_dot_q8_0_q8_0`, ...) multiply the integer sums by
    fp16(d_weight) * fp16(d_activation).
    """
    d, q = _q8_32(x)
    return (round_f16(d) * q).reshape(x.shape).to(x.dtype)


def quantize_q8_1(x):
    """Q8_1 activation values and the block-sum error the Q4_1/Q5_1 dot product adds.

    `quantize_row_q8_1` (ggml/src/ggml-cpu/arch/x86/quants.c): like Q8_0, plus
    s = fp16(d * sum(q)) per block, with d the unrounded float scale. `ggml_vec_dot_q4_1_q8_1`
    (same file) computes, per block, fp16(d_w) * fp16(d_x) * sum(q_w * q_x) + fp16(m_w) * s: the
    weight offset m meets the stored s, not fp16(d_x) * sum(q_x). Returns (values, s_err) with
    values = fp16(d) * q (shape of x) and s_err = s - fp16(d) * sum(q), shape (..., n_blocks); the
    exact result is `values @ W_deq.T + s_err @ M.T` with M the weight's per-block offsets.
    """
    d, q = _q8_32(x)
    d16 = round_f16(d)
    qsum = q.sum(-1, keepdim=True)
    s = round_f16(d * qsum)
    return (d16 * q).reshape(x.shape).to(x.dtype), (s - d16 * qsum).squeeze(-1).to(x.dtype)


def quantize_q8_K(x):
    """The values a Q8_K activation row stands for: d * q per block of 256 (d stays float32).

    `quantize_row_q8_K_ref` (ggml/src/ggml-quants.c; the x86 `quantize_row_q8_K` calls it): max is
    the signed value of largest magnitude (first one on ties), iscale = -127 / max,
    q = min(127, nearest_int(iscale * x)) with `nearest_int` rounding ties to even, d = 1 / iscale.
    """
    xb = _blocks(x.float(), QK_K)
    idx = xb.abs().argmax(-1, keepdim=True)
    mx = torch.gather(xb, -1, idx)
    iscale = _rdiv(-127.0, mx)  # an all-zero block gets d = 0, q = 0
    q = torch.round(iscale * xb).clamp(max=127)
    d = _rdiv(1.0, iscale)
    return (d * q).reshape(x.shape).to(x.dtype)


def round_activations(x, weight_type: str):
    """x as llama.cpp's CPU matrix product with `weight_type` weights sees it (Q8_1 without s, see
    `EmulatedLinear` for the exact Q4_1/Q5_1 product)."""
    t = vec_dot_type(weight_type)
    if t == "F32":
        return x
    if t == "F16":
        return round_f16(x)
    if t == "BF16":
        return round_bf16(x)
    if t == "Q8_0":
        return quantize_q8_0(x)
    if t == "Q8_1":
        return quantize_q8_1(x)[0]
    return quantize_q8_K(x)


def block_offsets(tensor: Any) -> np.ndarray | None:
    """Per-block offsets m (out, in/32) of a Q4_1/Q5_1 tensor read by gguf's GGUFReader, else None.

    Both block layouts start with fp16 d, fp16 m (`block_q4_1`, `block_q5_1` in ggml-common.h).
    """
    name = tensor.tensor_type.name
    if name not in _Q8_1:
        return None
    from gguf.constants import GGML_QUANT_SIZES

    _, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    raw = np.ascontiguousarray(np.asarray(tensor.data, dtype=np.uint8)).reshape(-1, type_size)
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    rows = int(np.prod([int(s) for s in tensor.shape[1:]])) if len(tensor.shape) > 1 else 1
    return m.reshape(rows, -1)


class EmulatedLinear:
    """`F.linear(x, w, b)` as llama.cpp's CPU backend computes it for weights of `weight_type`."""

    def __init__(self, weight_type: str, offsets=None):
        self.weight_type = weight_type
        self.kind = vec_dot_type(weight_type)
        self.offsets = None if offsets is None else torch.as_tensor(offsets)

    def __call__(self, x, w, b=None):
        if self.kind == "Q8_1":
            xq, s_err = quantize_q8_1(x)
            y = F.linear(xq, w, b)
            if self.offsets is not None and self.offsets.shape == (w.shape[0], s_err.shape[-1]):
                y = y + F.linear(s_err, self.offsets.to(y.dtype))
            return y
        return F.linear(round_activations(x, self.weight_type), w, b)


def round_cache(x, cache_type: str = "F16"):
    """K or V as stored in llama.cpp's KV cache of `cache_type` (F16 by default, or BF16/F32)."""
    t = cache_type.upper()
    if t == "F16":
        return round_f16(x)
    if t == "BF16":
        return round_bf16(x)
    if t == "F32":
        return x
    raise ValueError(f"KV cache type {cache_type!r} is not emulated (F16, BF16 or F32)")


def attention(q, k, v, cache_type: str = "F16", flash: bool = True):
    """Causal attention as llama.cpp's CPU backend computes it, q/k/v of shape (B, H, T, D).

    K and V are rounded to the cache type (llama.cpp stores them in the KV cache before attending).

    flash=True (the default for CPU contexts, `flash_attn_type` auto): `ggml_compute_forward_flash_attn_ext_f16`
    (ggml/src/ggml-cpu/ops.cpp) takes the tiled path for prompt batches (at least one query tile of
    rows): q stays float32, K and V tiles are converted back to float32, scores, softmax and the
    V product run in float32. (Single-token decoding takes the one-chunk path instead, which
    converts q to the K type and accumulates V in an fp16 accumulator; that is not emulated.)

    flash=False: `ggml_mul_mat(k, q)` converts q to fp16 (vec_dot_type of F16 K), the softmax runs
    in float32, and `ggml_mul_mat(v, kq)` converts the softmax weights to fp16.
    """
    k, v = round_cache(k, cache_type), round_cache(v, cache_type)
    if flash or cache_type.upper() == "F32":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rnd = round_bf16 if cache_type.upper() == "BF16" else round_f16
    T, S = q.shape[-2], k.shape[-2]
    scores = rnd(q) @ k.transpose(-1, -2) * (1.0 / q.shape[-1] ** 0.5)
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return rnd(p) @ v


class Emulation:
    """What the reference forward needs to compute like llama.cpp's CPU backend for one GGUF:
    each weight's GGML type (by GGUF tensor name), the Q4_1/Q5_1 block offsets, the KV cache type
    and the attention kernel (see `attention`)."""

    def __init__(self, weight_types: dict[str, str], offsets: dict[str, Any] | None = None,
                 cache_type: str = "F16", flash_attn: bool = True):
        self.weight_types = dict(weight_types)
        self.offsets = dict(offsets or {})
        self.cache_type = cache_type
        self.flash_attn = flash_attn
        round_cache(torch.zeros(1), cache_type)  # refuse unsupported cache types now

    @classmethod
    def from_source(cls, src, cache_type: str = "F16", flash_attn: bool = True) -> Emulation:
        types = {name: t.tensor_type.name for name, t in src.tensors.items()}
        offsets = {}
        for name, t in src.tensors.items():
            m = block_offsets(t)
            if m is not None:
                offsets[name] = m
        return cls(types, offsets, cache_type, flash_attn)

    def linear(self, name: str) -> EmulatedLinear:
        return EmulatedLinear(self.weight_types[name], self.offsets.get(name))

    def attention(self, q, k, v):
        return attention(q, k, v, self.cache_type, self.flash_attn)
