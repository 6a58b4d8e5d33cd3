"""Recovery: logit distillation of the pruned model from the unpruned one (CPU, torch).

Only the FFN weights (gate, up, down and the down bias where there is one) are trained: they are
what pruning changed, and freezing the rest keeps the backward pass and the optimiser state small.
The teacher's logits come from its cached final hidden states (`calibrate.collect`) through the
shared output head, so the teacher never runs during training. Training uses prefixes of the
calibration windows: with causal attention the teacher's state at position t depends only on
tokens 0..t, so a prefix is an exact sub-problem.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .errors import require_torch


@dataclass
class DistillReport:
    steps: int
    seq_len: int
    batch: int
    lr: float
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def distill(student, tokens: np.ndarray, teacher_hidden: np.ndarray, steps: int, *, lr: float = 3e-4,
            batch: int = 4, seq_len: int = 128, seed: int = 0, progress: bool = True,
            should_stop=None) -> DistillReport:
    import time

    torch = require_torch()
    F = torch.nn.functional
    from tqdm import tqdm

    rep = DistillReport(steps=steps, seq_len=seq_len, batch=batch, lr=lr)
    if steps <= 0:
        return rep
    seq_len = min(seq_len, tokens.shape[1])
    gen = torch.Generator().manual_seed(seed)
    for p in student.parameters():
        p.requires_grad_(False)
    params = student.ffn_parameters()
    params += [layer.down_bias for layer in student.layers if layer.down_bias is not None]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    toks = torch.from_numpy(tokens[:, :seq_len].astype(np.int64))
    hid = torch.from_numpy(teacher_hidden[:, :seq_len])
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc="distilling", unit="step", disable=not progress)
    student.train()
    try:
        for _ in bar:
            if should_stop is not None and should_stop():
                break
            idx = torch.randint(0, toks.shape[0], (batch,), generator=gen)
            x = toks[idx]
            with torch.no_grad():
                t_logp = F.log_softmax(student.head(hid[idx].float()), -1)
            s_logp = F.log_softmax(student(x), -1)
            loss = F.kl_div(s_logp.flatten(0, 1), t_logp.flatten(0, 1), log_target=True, reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            rep.losses.append(loss.item())
            bar.set_postfix(kl=f"{rep.losses[-1]:.4f}")
    finally:
        bar.close()
        student.eval()
        for p in params:
            p.requires_grad_(False)
        rep.seconds = time.perf_counter() - t0
    return rep
