"""Quantisation-aware recovery: train through the rounding llama.cpp's quantiser will apply.

A pruned model is written back in the source's quantisation, so every tensor distillation changes
is rounded again afterwards. For a 4-bit file that rounding is not small: re-quantising the
re-fitted FFN down projections of SmolLM2-135M at keep 0.63 raised held-out perplexity by about 8%
(reference forward, float vs rounded weights). Training through it removes that loss: the forward
uses `fake_quant(W)`, exactly the values `llama_model_quantize` will store, and the gradient passes
straight through the rounding (straight-through estimator). The exported tensors are those rounded
values, so quantising them again is exact.

Emulated are the block formats whose quantiser is a closed formula (ggml-quants.c,
`quantize_row_<type>_ref`, used by `llama_model_quantize` when no importance matrix is given):
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, plus F16/BF16 (a cast). K-quants search for their scales
(`make_qkx2_quants` and friends) and are not emulated: such tensors train in float32 and are
rounded once at the end.
"""
from __future__ import annotations

from ..errors import require_torch
from ..reference import MATRICES, TENSORS

torch = require_torch()

QK = 32  # block length of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, along each row (the input dimension)

FFN = ("gate", "up", "down", "down_bias")


def _blocks(w):
    rows, cols = w.shape
    return w.reshape(rows, cols // QK, QK)


def _f16(x):
    return x.half().float()


def _round_q4_1(b, levels: int):
    """Q4_1 / Q5_1: d = (max - min) / levels, q = (int)((x - min) / d + 0.5); value = q*fp16(d) + fp16(min)."""
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / levels
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.floor((b - lo) * inv + 0.5).clamp(0, levels)
    return q * _f16(d) + _f16(lo)


def _round_q4_0(b, half: int):
    """Q4_0 / Q5_0: d = m / -half with m the value of largest magnitude, q = min(2*half-1, (int)(x/d + half + 0.5))."""
    idx = b.abs().argmax(-1, keepdim=True)
    m = torch.gather(b, -1, idx)
    d = m / -half
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.floor(b * inv + (half + 0.5)).clamp(0, 2 * half - 1)  # the C cast truncates; values are >= 0 here
    return (q - half) * _f16(d)


def _round_q8_0(b):
    """Q8_0: d = max|x| / 127, q = roundf(x / d) (half away from zero); value = q*fp16(d)."""
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    x = b * inv
    q = torch.sign(x) * torch.floor(x.abs() + 0.5)
    return q * _f16(d)


_BLOCK = {
    "Q4_0": lambda b: _round_q4_0(b, 8), "Q5_0": lambda b: _round_q4_0(b, 16),
    "Q4_1": lambda b: _round_q4_1(b, 15), "Q5_1": lambda b: _round_q4_1(b, 31),
    "Q8_0": _round_q8_0,
}


def emulated(type_name: str) -> bool:
    return type_name in _BLOCK or type_name in ("F16", "BF16", "F32")


def round_like(w, type_name: str):
    """The values llama.cpp's quantiser stores for float weights `w` (rows, cols) in `type_name`."""
    if type_name == "F32":
        return w
    if type_name == "F16":
        return _f16(w)
    if type_name == "BF16":
        return w.bfloat16().float()
    if type_name not in _BLOCK or w.dim() != 2 or w.shape[1] % QK:
        raise ValueError(f"no emulation of llama.cpp's {type_name} quantiser for shape {tuple(w.shape)}")
    return _BLOCK[type_name](_blocks(w)).reshape(w.shape)


class FakeQuant(torch.nn.Module):
    """A parametrisation: forward sees the rounded weight, backward passes the gradient straight through."""

    def __init__(self, type_name: str):
        super().__init__()
        self.type_name = type_name

    def forward(self, w):
        # r + (w - w.detach()) is r exactly (x - x == 0 in floating point) with w's gradient; the
        # usual w + (r - w).detach() can land one ulp off the grid.
        return round_like(w.detach(), self.type_name) + (w - w.detach())


def attach(model, types: dict[str, str]) -> list[str]:
    """Fake-quantise the matrices of `model` (a reference RefModel) by their GGUF tensor types.

    `types` maps GGUF tensor names (blk.i.ffn_down.weight, ...) to GGML type names. Returns the
    names that are emulated; the others train in float (see the module docstring).
    """
    from torch.nn.utils import parametrize

    done = []
    for i, layer in enumerate(model.layers):
        for attr in MATRICES:
            name = f"blk.{i}.{TENSORS[attr]}"
            t = types.get(name)
            if t is None or t == "F32" or not emulated(t) or getattr(layer, attr).shape[1] % QK:
                continue
            parametrize.register_parametrization(layer, attr, FakeQuant(t))
            done.append(name)
    return done


def detach(model) -> None:
    """Remove the parametrisations, leaving the rounded values as the weights."""
    from torch.nn.utils import parametrize

    for layer in model.layers:
        for attr in MATRICES:
            if parametrize.is_parametrized(layer, attr):
                parametrize.remove_parametrizations(layer, attr, leave_parametrized=True)


def trainable(model, which: str) -> dict[str, torch.nn.Parameter]:
    """The parameters recovery trains, by GGUF tensor name: "ffn" (what pruning changed) or "all"
    (every block tensor and the output norm; the token embedding, shared with the output head the
    teacher's logits come through, stays frozen)."""
    from torch.nn.utils import parametrize

    attrs = FFN if which == "ffn" else tuple(TENSORS)
    out = {}
    for i, layer in enumerate(model.layers):
        for attr in attrs:
            if parametrize.is_parametrized(layer, attr):
                p = layer.parametrizations[attr].original
            else:
                p = getattr(layer, attr, None)
            if p is not None:
                out[f"blk.{i}.{TENSORS[attr]}"] = p
    if which != "ffn":
        out["output_norm.weight"] = model.out_norm
    return out


def export(model, names) -> dict:
    """Current values (rounded where fake-quantised) of the named tensors, as float32 numpy arrays."""
    owner = {"output_norm.weight": (model, "out_norm")}
    for i, layer in enumerate(model.layers):
        for attr, suffix in TENSORS.items():
            owner[f"blk.{i}.{suffix}"] = (layer, attr)
    with torch.no_grad():
        return {n: getattr(*owner[n]).detach().float().cpu().numpy().copy() for n in names}
