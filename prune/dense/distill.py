"""Recovery: logit distillation of the pruned model from the unpruned one (torch, on the models' device).

The student learns the teacher's next-token distribution (KL divergence over the full vocabulary)
on calibration text. What it trains is a choice (`train`): "ffn", the FFN weights pruning changed,
or "all", every tensor of every block and the output norm, which recovers more per step because
attention can adapt to the narrower FFNs; the token embedding stays frozen (it is the tied output
head of the models we target, and frozen it keeps the teacher and student heads identical).

The teacher runs alongside (no gradients), so the text is not limited to what the calibration pass
saw: batches mix code and prose windows from the whole calibration corpus in fixed shares (even by
default), in a seeded order.
With `quant_types` the matrices train through llama.cpp's quantiser (qat.py), so the file written
afterwards holds what was trained. A checkpoint (trained tensors, optimiser, position in the data)
is written every `checkpoint_every` steps; a run interrupted after one resumes from it.

On a GPU (the models' device) the forward passes run under bf16 autocast and the loss is read back
every `sync_every` steps, not every step, so the GPU is not stalled by a host round trip per step.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..device import autocast as amp
from ..errors import require_torch
from ..files import atomic_path

log = logging.getLogger("comfyui_a3b.prune")

#: a training step's share of the float32 matrix-product speed device.matmul_speed measures (the rest:
#: softmax, norms, rounding through the quantiser, recomputation, the optimiser): 0.33 measured with
#: SmolLM2-135M on a 2-core machine (8.2 s per step of 8 x 128 tokens, against 400 GFLOP/s measured)
STEP_EFFICIENCY = 0.33
#: steps timed before the time of the rest is said (the first one also sets up the optimiser)
TIMED_STEPS = 2
SHORTER = ("fewer steps make it shorter (--recover-steps N; 0 = no recovery, one-shot pruning in minutes), "
           "and so does a CUDA GPU (--device cuda)")


@dataclass
class DistillReport:
    steps: int
    seq_len: int
    batch: int
    lr: float
    train: str = "all"
    losses: list[float] = field(default_factory=list)
    trained: list[str] = field(default_factory=list)      # GGUF names of the tensors trained
    emulated: list[str] = field(default_factory=list)     # of those, trained through the quantiser
    tokens: int = 0
    resumed_at: int = 0
    seconds: float = 0.0


class Batches:
    """Seeded, endless batches that take windows from each kind (code, prose, ...) in fixed shares.

    `shares` (default: equal) is the fraction of windows from each kind; slot after slot, the kind
    furthest below its share is taken, so every batch follows the shares as closely as it can.
    """

    def __init__(self, kinds: list[np.ndarray], batch: int, seed: int, shares: list[float] | None = None):
        keep = [i for i, k in enumerate(kinds) if len(k)]
        if not keep:
            raise ValueError("no recovery windows")
        self.kinds = [kinds[i] for i in keep]
        w = [float(shares[i]) if shares else 1.0 for i in keep]
        self.shares = [x / sum(w) for x in w]
        self.batch = batch
        self.rng = np.random.default_rng(seed)
        self.orders = [self.rng.permutation(len(k)) for k in self.kinds]
        self.pos = [0] * len(self.kinds)
        self.taken = [0] * len(self.kinds)

    def next(self) -> np.ndarray:
        rows = []
        for _ in range(self.batch):
            turn = sum(self.taken) + 1
            k = max(range(len(self.kinds)), key=lambda i: (self.shares[i] * turn - self.taken[i], -i))
            self.taken[k] += 1
            if self.pos[k] == len(self.orders[k]):
                self.orders[k] = self.rng.permutation(len(self.kinds[k]))
                self.pos[k] = 0
            rows.append(self.kinds[k][self.orders[k][self.pos[k]]])
            self.pos[k] += 1
        return np.stack(rows)

    def state(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "orders": self.orders, "pos": self.pos, "taken": self.taken}

    def restore(self, st: dict) -> None:
        self.rng.bit_generator.state = st["rng"]
        self.orders, self.pos, self.taken = st["orders"], st["pos"], st["taken"]


def notifier(progress: bool, notify: Callable[[str], None] | None = None) -> Callable[[str], None]:
    """How a line for the user is said: by `notify` (the caller's: the command prints it), else on the
    terminal, else (no progress bars: a node, a library call) in the log; beside the bars where they show."""
    def say(message: str) -> None:
        if not progress:
            (notify or log.info)(message)
            return
        from tqdm import tqdm

        with tqdm.external_write_mode(file=sys.stderr):
            (notify or (lambda m: print(m, file=sys.stderr)))(message)
    return say


def duration(seconds: float) -> str:
    m = int(round(seconds / 60))
    return f"{m // 60} h {m % 60:02d} min" if m >= 60 else f"{max(m, 1)} min"


def step_flops(n_params: int, vocab: int, n_embd: int, tokens: int, teacher_params: int) -> float:
    """Floating-point operations of one step (2 per multiply-add): the teacher's forward, the student's
    forward, its recomputation and its backward pass (twice the forward), and both heads."""
    return 2.0 * tokens * (teacher_params + 4 * n_params + 4 * vocab * n_embd)


def estimate(steps: int, flops_per_step: float, flops_per_s: float) -> float:
    return steps * flops_per_step / (flops_per_s * STEP_EFFICIENCY)


def distill(student, teacher, windows: list[np.ndarray], steps: int, *, lr: float = 5e-4, batch: int = 8,
            seed: int = 0, train: str = "all", quant_types: dict[str, str] | None = None,
            shares: list[float] | None = None,
            checkpoint: str | os.PathLike | None = None, checkpoint_every: int = 50, progress: bool = True,
            should_stop=None, autocast: bool = True, sync_every: int = 10,
            notify: Callable[[str], None] | None = None) -> DistillReport:
    """Train `student` towards `teacher` for `steps` steps of `batch` windows.

    `windows` is one (n, seq_len) int array per kind of text; batches mix the kinds by `shares`
    (default: equal).
    """
    torch = require_torch()
    from tqdm import tqdm

    from . import qat  # imports torch

    dev = student.device
    seq_len = int(windows[0].shape[1]) if windows else 0
    rep = DistillReport(steps=steps, seq_len=seq_len, batch=batch, lr=lr, train=train)
    if steps <= 0:
        return rep
    for p in student.parameters():
        p.requires_grad_(False)
    if quant_types:
        rep.emulated = qat.attach(student, quant_types)
    named = qat.trainable(student, train)
    rep.trained = list(named)
    params = list(named.values())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98), fused=True)
    pending: list = []  # losses still on the device

    def flush() -> None:
        if pending:
            rep.losses.extend(float(v) for v in torch.stack(pending).cpu())
            pending.clear()
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: ((s + 1) / warm if s < warm
                        else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))))
    data = Batches(windows, batch, seed, shares)
    start = _resume(checkpoint, named, opt, sched, data, rep) if checkpoint else 0
    rep.resumed_at = start
    teacher.eval()
    student.checkpoint = dev.type == "cpu"  # see kl_step
    t0 = time.perf_counter()
    bar = tqdm(total=steps, initial=start, desc="distilling", unit="step", disable=not progress)
    student.train()
    step = start
    try:
        while step < steps:
            if should_stop is not None and should_stop():
                break
            x = torch.from_numpy(data.next().astype(np.int64)).to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = kl_step(student, teacher, x, autocast)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            pending.append(loss.detach())
            rep.tokens += x.numel()
            bar.update(1)
            if step == start + TIMED_STEPS and steps - step > 0:
                per = (time.perf_counter() - t0) / TIMED_STEPS
                left = per * (steps - step)
                notifier(progress, notify)(
                    f"recovery: {per:.1f} s per step measured here, about {duration(left)} for the {steps - step} "
                    f"steps left (until {time.strftime('%H:%M', time.localtime(time.time() + left))}); {SHORTER}.")
            if step % sync_every == 0 or step == steps or dev.type == "cpu":
                flush()
                bar.set_postfix(kl=f"{np.mean(rep.losses[-10:]):.4f}")
            if checkpoint and (step % checkpoint_every == 0 or step == steps):
                flush()
                _save(checkpoint, step, named, opt, sched, data, rep)
    finally:
        flush()
        bar.close()
        student.eval()
        student.checkpoint = False
        for p in params:
            p.requires_grad_(False)
            p.grad = None  # as large as what was trained: gone before the export copies it
        if quant_types:
            qat.detach(student)  # the weights become the rounded values llama.cpp will store
        rep.seconds = time.perf_counter() - t0
    return rep


#: Vocabulary-sized logits are made for this many bytes of tokens at a time (see kl_step): 42 tokens
#: of a 49k vocabulary, where the head's products are still large enough to run at full speed. On a
#: GPU the logits are not the process's memory, and larger slices keep its products large.
LOGITS_CHUNK_BYTES = 8 << 20
GPU_LOGITS_CHUNK_BYTES = 1 << 30


def kl_step(student, teacher, x, autocast: bool = True):
    """KL(teacher || student) over the full vocabulary, averaged over the tokens of batch `x`, with its
    gradient accumulated into the student's parameters; returns the loss (detached).

    The same value and gradient as the KL of the two models' whole logit tensors, in bounded memory:
    a (tokens x vocabulary) float32 tensor is 200 MB for 8 x 128 tokens of a 49k vocabulary (and
    log-softmax, the KL and their gradients hold several), while the models' final hidden states are
    the vocabulary / n_embd'th of that. So both models stop at their hidden states; the head, the
    log-softmax and the KL then run over slices of the tokens, each slice's backward pass leaves its
    gradient at the student's hidden states, and one backward pass through the student follows. On
    the CPU (`student.checkpoint`, set by distill) the student's layers also keep only their inputs
    for the backward pass and compute the rest again (activation checkpointing: about a third more
    compute, for a step whose memory no longer grows with depth x batch).
    """
    torch = require_torch()
    F = torch.nn.functional
    dev = str(x.device.type)
    with torch.no_grad(), amp(dev, autocast):
        t_h = teacher.hidden(x).flatten(0, 1)
    with amp(dev, autocast):
        s_h = student.hidden(x)
    s_leaf = s_h.detach().requires_grad_(True)
    s_flat = s_leaf.flatten(0, 1)
    n = s_flat.shape[0]
    vocab = student.embd.shape[0] if student.output is None else student.output.shape[0]
    chunk = max(1, (LOGITS_CHUNK_BYTES if dev == "cpu" else GPU_LOGITS_CHUNK_BYTES) // (4 * vocab))
    total = torch.zeros((), device=x.device)
    for i in range(0, n, chunk):
        with torch.no_grad(), amp(dev, autocast):
            t_logp = F.log_softmax(teacher.head(t_h[i:i + chunk]).float(), -1)
        with amp(dev, autocast):
            s_logits = student.head(s_flat[i:i + chunk])
        part = F.kl_div(F.log_softmax(s_logits.float(), -1), t_logp, log_target=True, reduction="sum") / n
        part.backward()
        total += part.detach()
    s_h.backward(s_leaf.grad)
    return total


def _save(path, step, named, opt, sched, data, rep) -> None:
    torch = require_torch()
    # the tensors themselves, not copies: torch.save writes them out before training goes on
    state = {"step": step, "tensors": {n: p.detach() for n, p in named.items()},
             "opt": opt.state_dict(), "sched": sched.state_dict(), "data": data.state(),
             "losses": list(rep.losses), "tokens": rep.tokens}
    with atomic_path(path, force=True) as tmp:
        torch.save(state, tmp)


def _resume(path, named, opt, sched, data, rep) -> int:
    """Load a checkpoint written by an earlier run of the same settings; 0 if there is none (or it is damaged)."""
    torch = require_torch()
    path = Path(path)
    if not path.is_file():
        return 0
    try:
        st = torch.load(path, weights_only=False, map_location="cpu")
        if set(st["tensors"]) != set(named):
            return 0
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(st["tensors"][n])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        data.restore(st["data"])
        rep.losses[:] = st["losses"]
        rep.tokens = st["tokens"]
        return int(st["step"])
    except (OSError, RuntimeError, KeyError, ValueError, EOFError):
        return 0
