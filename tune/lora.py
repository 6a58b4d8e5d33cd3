"""LoRA over prune/'s torch reference forward: frozen base matrices, trained low-rank updates.

For a base matrix W (out x in) the layer computes W x + (alpha / r) B A dropout(x), A (r x in)
initialised like a linear layer's weight, B (out x r) at zero, so training starts from the base
model exactly. That is the update llama.cpp adds at inference for an adapter's
`<name>.lora_a` / `<name>.lora_b` pair (scale = alpha / rank, rank read from lora_b), so the
adapter written from A and B computes the same thing there.

The reference forward's layers compute every matrix product through `Layer._linear`, which calls
a per-layer table of callables when one is set (the table llama.cpp emulation uses); `attach`
sets a table whose entries add the LoRA update, so the reference forward is used as it is. With
`checkpoint`, each block's activations are recomputed in the backward pass instead of kept.
"""
from __future__ import annotations

import math

from ..prune.errors import require_torch
from ..prune.reference import TENSORS, RefModel, _rms, _rope_tables

torch = require_torch()
nn = torch.nn
F = torch.nn.functional

#: block attribute of the reference forward -> GGUF name inside a block, for the trainable matrices
ATTRS = {name.removesuffix(".weight"): attr for attr, name in TENSORS.items()
         if name.endswith(".weight") and attr in ("wq", "wk", "wv", "wo", "gate", "up", "down")}


class LoRA(nn.Module):
    def __init__(self, n_in: int, n_out: int, rank: int, alpha: float, dropout: float, gen=None):
        super().__init__()
        self.a = nn.Parameter(torch.empty(rank, n_in))
        self.b = nn.Parameter(torch.zeros(n_out, rank))
        bound = 1.0 / math.sqrt(n_in)   # kaiming-uniform with a = sqrt(5), as nn.Linear initialises
        with torch.no_grad():
            self.a.uniform_(-bound, bound, generator=gen)
        self.scale = alpha / rank
        self.drop = nn.Dropout(dropout)

    def delta(self, x):
        return F.linear(F.linear(self.drop(x), self.a), self.b) * self.scale


def _sdpa(q, k, v):
    # under bf16 autocast, q and k come out of float32 norms (qwen3) and v out of a bf16 product
    if q.dtype != v.dtype:
        q, k = q.to(v.dtype), k.to(v.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Adapted(nn.Module):
    """A RefModel with LoRA updates on `targets` (GGUF names: attn_q, ffn_up, ...) of every block."""

    def __init__(self, base: RefModel, targets: list[str], rank: int, alpha: float, dropout: float,
                 seed: int = 0, checkpoint: bool = False):
        super().__init__()
        self.base = base
        self.rank, self.alpha, self.targets = rank, alpha, list(targets)
        self.checkpoint = checkpoint
        for p in base.parameters():
            p.requires_grad_(False)
        gen = torch.Generator().manual_seed(seed)
        self.loras = nn.ModuleDict()
        for i, layer in enumerate(base.layers):
            for t in self.targets:
                w = getattr(layer, ATTRS[t])
                self.loras[f"blk_{i}_{t}"] = LoRA(w.shape[1], w.shape[0], rank, alpha, dropout, gen)
        self.loras.to(base.device)
        self.attach()

    def attach(self) -> None:
        for i, layer in enumerate(self.base.layers):
            table = {"attention": _sdpa}
            for name in ATTRS:
                lora = self.loras[f"blk_{i}_{name}"] if name in self.targets else None
                table[name] = _plain if lora is None else _with(lora)
            layer.emu = table

    def detach(self) -> None:
        for layer in self.base.layers:
            layer.emu = None

    def hidden(self, tokens):
        base = self.base
        x = F.embedding(tokens, base.embd).float()
        cos, sin = _rope_tables(base.hp, tokens.shape[1], freq_factors=base.freq_factors, device=base.device)
        for il, layer in enumerate(base.layers):
            if self.checkpoint and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, il, use_reentrant=False)
            else:
                x = layer(x, cos, sin, il)
        return _rms(x, base.out_norm, base.hp.eps)

    def forward(self, tokens):
        return self.base.head(self.hidden(tokens))

    def tensors(self) -> dict[str, tuple]:
        """GGUF base tensor name -> (A, B) as float32 numpy arrays, shapes (r, in) and (out, r)."""
        out = {}
        for key, m in self.loras.items():
            _, i, name = key.split("_", 2)
            out[f"blk.{i}.{name}.weight"] = (m.a.detach().float().cpu().numpy(), m.b.detach().float().cpu().numpy())
        return out

    def load_tensors(self, tensors: dict[str, tuple]) -> None:
        with torch.no_grad():
            for key, m in self.loras.items():
                _, i, name = key.split("_", 2)
                a, b = tensors[f"blk.{i}.{name}.weight"]
                m.a.copy_(torch.as_tensor(a))
                m.b.copy_(torch.as_tensor(b))

    def trainable(self) -> list:
        return list(self.loras.parameters())


def _plain(x, w, b):
    return F.linear(x, w, b)


def _with(lora: LoRA):
    def linear(x, w, b):
        return F.linear(x, w, b) + lora.delta(x)
    return linear


#: positions whose logits are computed at once when the head's activations are recomputed: a
#: 152K-token vocabulary makes 0.6 GB of bf16 logits per 2048 positions, kept for the backward pass
HEAD_CHUNK = 1024


def _chunk_nll(head, h, t, w):
    logits = head(h)
    return (F.cross_entropy(logits.float(), t, reduction="none") * w).sum()


def token_losses(model, tokens, weights):
    """Summed weighted next-token NLL and the summed weight, over a batch (B, T) of samples.

    With gradient checkpointing the output head and the loss are computed by chunks of positions,
    each recomputed in the backward pass, so the full-vocabulary logits never exist at once."""
    h = model.hidden(tokens)
    h = h.reshape(-1, h.shape[-1])
    t = tokens.roll(-1, dims=1).reshape(-1)
    w = weights.reshape(-1).to(h.device)
    head = model.base.head
    if not (model.checkpoint and torch.is_grad_enabled()):
        return _chunk_nll(head, h, t, w), w.sum()
    total = h.new_zeros((), dtype=torch.float32)
    for a in range(0, h.shape[0], HEAD_CHUNK):
        b = a + HEAD_CHUNK
        total = total + torch.utils.checkpoint.checkpoint(_chunk_nll, head, h[a:b], t[a:b], w[a:b],
                                                          use_reentrant=False)
    return total, w.sum()
