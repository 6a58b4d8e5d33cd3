"""The a3b method: sequential, error-correcting structured OBS over the FFN layers.

Layer by layer, the unpruned model (teacher) and the model pruned so far (student) run side by side
over the calibration windows. At layer l the student's FFN sees its own inputs (already shifted by
the pruning of layers < l), and its down projection is fitted by least squares to the output that
would bring the student's residual stream back to the teacher's after layer l:

    target = x_teacher[l+1] - (x_student[l] + attention_student)

so each layer also corrects the error that earlier layers left. Starting from the least-squares
optimum over all neurons, structured optimal-brain-surgeon steps remove the neurons whose removal
raises the squared error least, re-fitting the remaining columns each time (see `methods.obs_select`).
For llama a bias column is part of the fit (llama.cpp reads ffn_down.bias for llama only).
"""
from __future__ import annotations

import numpy as np

from ..errors import require_torch
from .methods import LayerPlan, obs_prune


def sequential_plans(teacher, tokens: np.ndarray, k: int, fit_bias: bool, *, batch: int = 4,
                     damp: float = 0.01, chunk: int = 8, progress: bool = True) -> list[LayerPlan]:
    torch = require_torch()
    from tqdm import tqdm

    from ..reference import _rms, _rope_tables  # imports torch

    hp = teacher.hp
    F = torch.nn.functional
    dev = teacher.device
    toks = torch.from_numpy(tokens.astype(np.int64)).to(dev)
    cos, sin = _rope_tables(hp, toks.shape[1], freq_factors=teacher.freq_factors, device=dev)
    with torch.no_grad():
        xt = F.embedding(toks, teacher.embd)
        xs = xt.clone()
    plans: list[LayerPlan] = []
    bar = tqdm(total=hp.n_layer, desc="pruning (a3b, sequential)", unit="layer", disable=not progress)
    for layer in teacher.layers:
        n = layer.gate.shape[0]
        m = n + (1 if fit_bias else 0)
        G = torch.zeros(m, m, dtype=torch.float64, device=dev)
        C = torch.zeros(m, hp.n_embd, dtype=torch.float64, device=dev)
        a_s_all = torch.empty_like(xs)
        with torch.no_grad():
            for i in range(0, toks.shape[0], batch):
                sl = slice(i, i + batch)
                at = xt[sl] + layer.attention(_rms(xt[sl], layer.attn_norm, hp.eps), cos, sin)
                xt[sl] = at + layer.ffn(_rms(at, layer.ffn_norm, hp.eps), 0, None)
                a_s = xs[sl] + layer.attention(_rms(xs[sl], layer.attn_norm, hp.eps), cos, sin)
                a_s_all[sl] = a_s
                u = _rms(a_s, layer.ffn_norm, hp.eps)
                h = (F.silu(F.linear(u, layer.gate)) * F.linear(u, layer.up)).reshape(-1, n)
                if fit_bias:
                    h = torch.cat([h, torch.ones(h.shape[0], 1, device=dev)], 1)
                target = (xt[sl] - a_s).reshape(-1, hp.n_embd)
                if layer.down_bias is not None and not fit_bias:
                    target = target - layer.down_bias
                G += (h.T @ h).double()
                C += (h.T @ target).double()
            Gd = G + damp * float(G.diagonal()[:n].mean()) * torch.eye(m, dtype=torch.float64, device=dev)
            W = torch.linalg.solve(Gd, C).T.contiguous()          # (n_embd, m): least-squares optimum
            plan = obs_prune(W, torch.linalg.inv(Gd), n, k, fit_bias, chunk)
            keep = torch.from_numpy(plan.keep).to(dev)
            down = torch.from_numpy(plan.down).to(dev)
            bias = torch.from_numpy(plan.bias).to(dev) if plan.bias is not None else layer.down_bias
            for i in range(0, toks.shape[0], batch):
                sl = slice(i, i + batch)
                u = _rms(a_s_all[sl], layer.ffn_norm, hp.eps)
                h = F.silu(F.linear(u, layer.gate[keep])) * F.linear(u, layer.up[keep])
                xs[sl] = a_s_all[sl] + F.linear(h, down, bias)
        plans.append(plan)
        bar.update(1)
    bar.close()
    return plans
