"""Attention-head pruning that keeps grouped-query attention intact.

In grouped-query attention every KV head serves a group of `rep = n_head / n_head_kv` query heads
(llama.cpp: query head j reads KV head j // rep). Removing a KV head would remove its whole group, so
only query heads are removed, and the same number `r` of them in every group and every layer: the
file then says n_head = n_head_kv * r, llama.cpp's mapping j // r still pairs each kept query head
with its own KV head, and every layer has the same shape (llama.cpp builds llama/qwen2/qwen3 layers
from one head count). What changes per layer is which heads stay.

Importance: query head h contributes W_o[:, h] o_h to the attention output (o_h is the head's output
before the output projection, head_dim values). Over calibration text its energy is
trace(W_o,h G_hh W_o,h^T) / count, with G the Gram matrix of the concatenated head outputs; the
`r` heads of highest energy in each group stay. The output projection is then re-fitted by least
squares, W_o' = W_o G[:, K] G[K, K]^-1, so the kept heads also carry what the removed ones added on
average (the same compensation the a3b FFN method applies to the down projection).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidRequest, require_torch
from ..files import load_npz, save_npz_atomic
from ..writing.gguf import RawTensor

GRAM_VERSION = 1

#: llama.cpp sizes attn_q from the head count and head size for these; for qwen2 it expects
#: n_embd x n_embd, so a qwen2 file with fewer query heads does not load.
HEAD_PRUNABLE = ("llama", "qwen3")


def heads_per_group(arch: str, n_head: int, n_head_kv: int, heads_keep: float) -> int:
    """Query heads kept in each KV group for a `heads_keep` fraction (at least one)."""
    rep = n_head // n_head_kv
    if heads_keep >= 1.0:
        return rep
    if arch not in HEAD_PRUNABLE:
        raise InvalidRequest(f"head pruning is available for the {', '.join(HEAD_PRUNABLE)} architectures; "
                             f"llama.cpp expects the full query projection in {arch!r} files, so a head-pruned one "
                             "would not load. Use --heads-keep 1.")
    if rep < 2:
        raise InvalidRequest(f"head pruning keeps every KV head and removes query heads within each KV group; "
                             f"this model has {n_head} query heads for {n_head_kv} KV heads (one per group), so "
                             "there is nothing to remove. Use --heads-keep 1.")
    return max(1, min(rep, int(round(rep * heads_keep))))


@dataclass
class HeadPlan:
    keep: np.ndarray      # kept query heads, ascending (indices into the source's heads)
    wo: np.ndarray        # re-fitted output projection, (n_embd, len(keep) * head_dim)
    energy: np.ndarray    # per source head


def collect_grams(model, tokens: np.ndarray, cache_path: Path | None = None, batch: int = 4,
                  progress: bool = True) -> list[np.ndarray]:
    """Per layer, the Gram matrix of the attention output before W_o (float64, averaged over tokens),
    cached at `cache_path` (keyed by the caller on the source and the calibration tokens)."""
    torch = require_torch()
    z = load_npz(cache_path) if cache_path is not None and cache_path.is_file() else None
    if z is not None and "n" in z and all(f"g{i}" in z for i in range(int(z["n"]))):
        return [z[f"g{i}"].astype(np.float64) for i in range(int(z["n"]))]  # else missing or damaged: recompute
    dim = model.hp.n_head * model.hp.head_dim
    acc = [torch.zeros(dim, dim, dtype=torch.float64, device=model.device) for _ in model.layers]

    def probe(il: int, o):
        x = o.reshape(-1, o.shape[-1])
        acc[il] += (x.T @ x).double()

    from tqdm import tqdm

    bar = tqdm(total=len(tokens), desc="calibrating heads", unit="seq", disable=not progress)
    for il, layer in enumerate(model.layers):
        layer.attn_probe = (lambda o, il=il: probe(il, o))
    try:
        with torch.no_grad():
            for i in range(0, len(tokens), batch):
                x = torch.from_numpy(np.asarray(tokens[i:i + batch], dtype=np.int64))
                model.hidden(x)
                bar.update(x.shape[0])
    finally:
        for layer in model.layers:
            layer.attn_probe = None
        bar.close()
    grams = [a.cpu().numpy() / max(1, tokens.size) for a in acc]
    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        save_npz_atomic(cache_path, {"n": np.array(len(grams)), **{f"g{i}": g.astype(np.float32)
                                                                    for i, g in enumerate(grams)}})
    return grams


def plan_heads(wo: np.ndarray, gram: np.ndarray, n_head: int, n_head_kv: int, head_dim: int, r: int,
               damp: float = 0.01) -> HeadPlan:
    """Keep the `r` highest-energy query heads of every KV group and re-fit W_o on them."""
    rep = n_head // n_head_kv
    energy = np.empty(n_head)
    for h in range(n_head):
        s = slice(h * head_dim, (h + 1) * head_dim)
        w = wo[:, s].astype(np.float64)
        energy[h] = np.einsum("ij,jk,ik->", w, gram[s, s], w)
    keep = np.sort(np.concatenate([g * rep + np.argsort(-energy[g * rep:(g + 1) * rep], kind="stable")[:r]
                                   for g in range(n_head_kv)]))
    cols = query_rows(keep, head_dim)  # the kept heads' columns of W_o are their rows of attn_q
    gkk = gram[np.ix_(cols, cols)]
    gkk = gkk + damp * np.mean(np.diag(gkk)) * np.eye(len(cols))
    refit = np.linalg.solve(gkk, gram[cols] @ wo.astype(np.float64).T).T  # W_o G[:, K] G[K, K]^-1
    return HeadPlan(keep, refit.astype(np.float32), energy)


def prune_heads(src, weights: dict[str, np.ndarray], grams: list[np.ndarray], r: int,
                student_w: dict, changed: dict) -> int:
    """Plan every layer and put the pruned tensors into `student_w` (float32, for the student) and
    `changed` (what the writer stores: query rows sliced from the stored bytes, the re-fitted W_o).
    Returns the new query head count."""
    hp = src.hp
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        plan = plan_heads(weights[p + "attn_output.weight"], grams[i], hp.n_head, hp.n_head_kv, hp.head_dim, r)
        rows = query_rows(plan.keep, hp.head_dim)
        student_w[p + "attn_q.weight"] = weights[p + "attn_q.weight"][rows]
        changed[p + "attn_q.weight"] = RawTensor.rows(src.raw(p + "attn_q.weight"), rows)
        if p + "attn_q.bias" in weights:
            student_w[p + "attn_q.bias"] = changed[p + "attn_q.bias"] = weights[p + "attn_q.bias"][rows]
        student_w[p + "attn_output.weight"] = changed[p + "attn_output.weight"] = plan.wo
    return hp.n_head_kv * r


def query_rows(keep: np.ndarray, head_dim: int) -> np.ndarray:
    """Rows of attn_q (and its bias) that belong to the kept heads."""
    return np.concatenate([np.arange(h * head_dim, (h + 1) * head_dim) for h in keep])


def gram_cache_path(cache: Path, stats_key: str) -> Path:
    return Path(cache) / f"heads-v{GRAM_VERSION}-{stats_key}.npz"
