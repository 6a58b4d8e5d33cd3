"""The frozen base for training: prune/'s reference forward over the GGUF's weights, dequantised once.

On the CPU the weights stay float32 (what the reference forward computes in). On a GPU the matrices
and the token embedding are stored as bf16 (half the memory: an 8B base takes 16 GB) and the
forward runs under bf16 autocast; norms, RoPE tables and the residual stream stay float32.
`random_base` builds the same model at any shape with random weights, for speed and memory
measurements without a file.
"""
from __future__ import annotations

from ..prune.errors import require_torch
from ..prune.reference import RefModel
from ..prune.source import HParams, SourceModel

torch = require_torch()

#: the tensors kept in bf16 on a GPU: the matrices and the token embedding / output head
_BF16 = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
         "ffn_up.weight", "ffn_down.weight")


def _is_matrix(name: str) -> bool:
    return name in ("token_embd.weight", "output.weight") or name.split(".", 2)[-1] in _BF16


def load_base(src: SourceModel, device: str) -> RefModel:
    """The reference forward over `src`, frozen, on `device` (one dequantisation, tensor by tensor)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    weights = {}
    for name in src.tensors:
        t = torch.from_numpy(src.weight(name))
        weights[name] = t.to(device=device, dtype=dtype if _is_matrix(name) else torch.float32)
    model = RefModel(src.hp, weights)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def random_base(hp: HParams, device: str, seed: int = 0) -> RefModel:
    """A RefModel of shape `hp` with random weights, built on `device` (bf16 matrices on a GPU)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(seed)

    def mat(rows: int, cols: int):
        return (torch.randn(rows, cols, generator=g, device=device, dtype=dtype) * cols ** -0.5)

    def ones(n: int):
        return torch.ones(n, device=device)

    q, kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    w = {"token_embd.weight": mat(hp.n_vocab, hp.n_embd), "output_norm.weight": ones(hp.n_embd)}
    if not hp.tied_output:
        w["output.weight"] = mat(hp.n_vocab, hp.n_embd)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        w.update({b + "attn_norm.weight": ones(hp.n_embd), b + "ffn_norm.weight": ones(hp.n_embd),
                  b + "attn_q.weight": mat(q, hp.n_embd), b + "attn_k.weight": mat(kv, hp.n_embd),
                  b + "attn_v.weight": mat(kv, hp.n_embd), b + "attn_output.weight": mat(hp.n_embd, q),
                  b + "ffn_gate.weight": mat(hp.n_ff, hp.n_embd), b + "ffn_up.weight": mat(hp.n_ff, hp.n_embd),
                  b + "ffn_down.weight": mat(hp.n_embd, hp.n_ff)})
        if hp.arch == "qwen3":
            w[b + "attn_q_norm.weight"] = ones(hp.head_dim)
            w[b + "attn_k_norm.weight"] = ones(hp.head_dim)
    model = RefModel(hp, w)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
