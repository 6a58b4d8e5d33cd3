"""A PyTorch reference forward for llama / qwen2 / qwen3 GGUFs (dequantised weights, float32).

It computes what llama.cpp computes for the same file (checked by `evaluate.agreement`), and gives
the pruning pipeline what llama.cpp cannot: per-neuron FFN statistics, gradients for distillation,
and a token-level FFN gate. FFN widths may differ per layer here (llama.cpp needs them equal).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .errors import require_torch
from .numerics import Emulation
from .source import HParams, SourceModel

torch = require_torch()
nn = torch.nn
F = torch.nn.functional

#: Called as hook(layer_index, h, a) with a = silu(gate(x)) and h = a * up(x), shapes (B, T, n_ff);
#: it may return a replacement for h (the dynamic gate) or None (statistics only).
FFNHook = Callable[[int, "torch.Tensor"], "torch.Tensor | None"]


def _rms(x, w, eps: float):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


#: Layer attribute -> GGUF tensor name inside a block (blk.<i>.<name>), for every tensor a block
#: may have; the optional ones exist only in some architectures (qwen2 biases, qwen3 q/k norms) or
#: after pruning with bias compensation (ffn_down.bias).
TENSORS = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight", "ffn_norm": "ffn_norm.weight",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight", "down_bias": "ffn_down.bias",
}
OPTIONAL = ("bq", "bk", "bv", "q_norm", "k_norm", "down_bias")
MATRICES = ("wq", "wk", "wv", "wo", "gate", "up", "down")


class Layer(nn.Module):
    def __init__(self, hp: HParams, w: dict[str, torch.Tensor]):
        super().__init__()
        self.hp = hp
        for attr, name in TENSORS.items():  # a missing required tensor raises KeyError naming it
            present = name in w or attr not in OPTIONAL
            setattr(self, attr, nn.Parameter(w[name], requires_grad=False) if present else None)
        self.emu = None  # numerics.Emulation-derived callables, set by RefModel(emulate=...)
        self.attn_probe = None  # called with the attention output before W_o (heads.collect_grams)

    def _linear(self, x, w, b, name: str):
        return F.linear(x, w, b) if self.emu is None else self.emu[name](x, w, b)

    def attention(self, x, cos, sin):
        hp = self.hp
        B, T, _ = x.shape
        q = self._linear(x, self.wq, self.bq, "attn_q").view(B, T, hp.n_head, hp.head_dim)
        k = self._linear(x, self.wk, self.bk, "attn_k").view(B, T, hp.n_head_kv, hp.head_dim)
        v = self._linear(x, self.wv, self.bv, "attn_v").view(B, T, hp.n_head_kv, hp.head_dim)
        if self.q_norm is not None:
            q = _rms(q, self.q_norm, hp.eps)
            k = _rms(k, self.k_norm, hp.eps)
        q, k = _rope(q, cos, sin, hp.rope_type), _rope(k, cos, sin, hp.rope_type)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rep = hp.n_head // hp.n_head_kv
        if rep > 1:  # llama.cpp broadcasts kv head j to q heads j*rep .. j*rep+rep-1
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.emu is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = self.emu["attention"](q, k, v)
        o = o.transpose(1, 2).reshape(B, T, hp.n_head * hp.head_dim)
        if self.attn_probe is not None:
            self.attn_probe(o)
        return self._linear(o, self.wo, None, "attn_output")

    def ffn(self, x, il: int, hook: FFNHook | None):
        a = F.silu(self._linear(x, self.gate, None, "ffn_gate"))
        h = a * self._linear(x, self.up, None, "ffn_up")
        if hook is not None:
            r = hook(il, h, a)
            if r is not None:
                h = r
        return self._linear(h, self.down, self.down_bias, "ffn_down")

    def forward(self, x, cos, sin, il: int, hook: FFNHook | None = None):
        x = x + self.attention(_rms(x, self.attn_norm, self.hp.eps), cos, sin)
        return x + self.ffn(_rms(x, self.ffn_norm, self.hp.eps), il, hook)


def _rope_tables(hp: HParams, T: int, offset: int = 0, freq_factors=None, device=None):
    half = hp.head_dim // 2
    inv = hp.rope_base ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / hp.head_dim)
    if freq_factors is not None:
        inv = inv / freq_factors.double().cpu()
    pos = (torch.arange(offset, offset + T, dtype=torch.float64) * hp.rope_scale)
    ang = torch.outer(pos, inv)
    return torch.cos(ang).float().to(device), torch.sin(ang).float().to(device)


def _rope(x, cos, sin, kind: str):
    # x: (B, T, H, D); cos/sin: (T, D/2)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    if kind == "neox":
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)


class RefModel(nn.Module):
    """`emulate` (a `numerics.Emulation`, off by default) rounds activations before every matrix
    product and K/V to the cache type as llama.cpp's CPU backend does, to compare logits with
    llama.cpp on quantised files; it is for evaluation only (rounding has no useful gradient)."""

    def __init__(self, hp: HParams, weights: dict[str, np.ndarray | torch.Tensor], emulate=None, layers=None):
        """`layers`: the blocks, where they do not come from `weights` (StreamedLayers)."""
        super().__init__()
        self.hp = hp
        t = {k: torch.as_tensor(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
             for k, v in weights.items()}
        self.embd = nn.Parameter(t["token_embd.weight"], requires_grad=False)
        self.out_norm = nn.Parameter(t["output_norm.weight"], requires_grad=False)
        self.output = None if hp.tied_output else nn.Parameter(t["output.weight"], requires_grad=False)
        self.freq_factors = t.get("rope_freqs.weight")
        self.layers = layers if layers is not None else nn.ModuleList(
            Layer(hp, {k.split(".", 2)[2]: v for k, v in t.items() if k.startswith(f"blk.{i}.")})
            for i in range(hp.n_layer))
        self.emulate = emulate
        self._head_emu = None
        #: keep only each layer's input for the backward pass and compute the rest again (distill.kl_step)
        self.checkpoint = False
        if emulate is not None:
            for i, layer in enumerate(self.layers):
                layer.emu = {TENSORS[a].removesuffix(".weight"): emulate.linear(f"blk.{i}.{TENSORS[a]}")
                             for a in MATRICES}
                layer.emu["attention"] = emulate.attention
            self._head_emu = emulate.linear("token_embd.weight" if hp.tied_output else "output.weight")

    @classmethod
    def from_source(cls, src: SourceModel, emulate_llamacpp: bool = False) -> RefModel:
        """`emulate_llamacpp`: compute like llama.cpp's CPU backend on this file (see `numerics`)."""
        emulate = None
        if emulate_llamacpp:
            emulate = Emulation.from_source(src)
        return cls(src.hp, {name: src.weight(name) for name in src.tensors}, emulate)

    @property
    def device(self):
        return self.embd.device

    @property
    def ffn_widths(self) -> list[int]:
        return [int(layer.gate.shape[0]) for layer in self.layers]

    def hidden(self, tokens, hook: FFNHook | None = None):
        """Final normed hidden states (B, T, n_embd)."""
        if tokens.dim() == 1:
            tokens = tokens[None]
        tokens = tokens.to(self.embd.device)
        x = F.embedding(tokens, self.embd)
        cos, sin = _rope_tables(self.hp, tokens.shape[1], freq_factors=self.freq_factors, device=self.embd.device)
        for il, layer in enumerate(self.layers):
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, il, hook, use_reentrant=False)
            else:
                x = layer(x, cos, sin, il, hook)
        return _rms(x, self.out_norm, self.hp.eps)

    def head(self, h):
        w = self.embd if self.output is None else self.output
        return F.linear(h, w) if self._head_emu is None else self._head_emu(h, w)

    def forward(self, tokens, hook: FFNHook | None = None):
        return self.head(self.hidden(tokens, hook))

    def ffn_parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in (layer.gate, layer.up, layer.down)]


class StreamedLayers:
    """The blocks of `src` for a forward without gradients, each dequantised from the file's stored bytes
    when the forward reaches it and dropped after it: the same values as a model built from
    `src.weight` (so the same outputs), in the memory of one block instead of the model's. Recovery's
    teacher on the CPU (dense/torch_path.py): it costs one dequantisation of the blocks per forward,
    a few percent of a distillation step there."""

    def __init__(self, src: SourceModel):
        self.src = src
        self.hp = src.hp
        self._names = [[n for n in src.tensors if n.startswith(f"blk.{i}.")] for i in range(src.hp.n_layer)]

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self):
        for i, names in enumerate(self._names):
            p = f"blk.{i}."
            # each tensor's pages of the file go once read: touched by every forward, they would
            # otherwise keep the whole file resident beside the student (SourceModel.release)
            yield Layer(self.hp, {n[len(p):]: torch.from_numpy(self.src.weight(n, release=True)) for n in names})


@torch.no_grad()
def nll(model: RefModel, seqs: list[list[int]], hook: FFNHook | None = None) -> tuple[float, int]:
    """Summed next-token negative log-likelihood and token count over sequences (each scored alone)."""
    total, n = 0.0, 0
    for s in seqs:
        x = torch.tensor(s, dtype=torch.long, device=model.device)
        logits = model(x, hook)[0, :-1]
        total += float(F.cross_entropy(logits, x[1:], reduction="sum"))
        n += len(s) - 1
    return total, n


def perplexity(model: RefModel, seqs: list[list[int]], hook: FFNHook | None = None) -> float:
    total, n = nll(model, seqs, hook)
    return math.exp(total / max(n, 1))
