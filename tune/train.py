"""The training loop: AdamW on the LoRA tensors only, held-out loss, early stopping, Ctrl-C, resume.

Steps: `--steps`, else `--epochs` passes over the training samples (rebuilt each epoch with that
epoch's seed, so FIM samples cut their middles elsewhere). The learning rate warms up over the first
5% of the steps, then decays along a cosine to a tenth. The held-out loss (the weighted token-mean
NLL of the held-out files' samples, dropout off) is measured before the first step (the base model:
the adapter starts at zero) and every `eval_every` steps; the best adapter so far is kept, and
training stops after `patience` evaluations without a better one. Ctrl-C ends training at once and
keeps the best adapter so far. A checkpoint (adapter, optimiser, step, best, history) is written at
every evaluation; a run started again with the same settings resumes from it.

On CUDA the forward runs under bf16 autocast (prune/device.py); the adapter stays float32.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np

from ..prune.device import autocast
from ..prune.errors import require_torch
from ..prune.files import atomic_path
from .lora import Adapted, token_losses
from .samples import Samples

torch = require_torch()

#: a held-out loss this much lower (relative) than the best counts as better
MIN_GAIN = 1e-3


@dataclass
class History:
    evals: list[tuple[int, float]] = field(default_factory=list)   # (step, held-out loss)
    losses: list[float] = field(default_factory=list)               # training loss per step
    tokens: int = 0
    seconds: float = 0.0
    best_step: int = 0
    best: float = math.inf
    stopped: str = "done"        # done, early, interrupted

    @property
    def base_loss(self) -> float:
        return self.evals[0][1] if self.evals else math.nan


def evaluate(model: Adapted, samples: Samples, batch: int, device: str) -> float:
    """The weighted token-mean NLL of `samples` (dropout off, no gradients)."""
    was = model.training
    model.eval()
    total, n = 0.0, 0.0
    with torch.no_grad(), autocast(device):
        for a in range(0, len(samples), batch):
            x = torch.from_numpy(samples.tokens[a:a + batch]).to(device)
            w = torch.from_numpy(samples.weights[a:a + batch]).to(device)
            s, c = token_losses(model, x, w)
            total += float(s)
            n += float(c)
    model.train(was)
    return total / max(n, 1.0)


class Stream:
    """Batch `k` of the run, the same on every run with the same seed (so a resumed run goes on)."""

    def __init__(self, build: Callable[[int], Samples], batch: int, seed: int):
        self.build, self.batch, self.seed = build, batch, seed
        self._epoch, self._samples = -1, None
        self.per_epoch = max(1, math.ceil(len(self.samples(0)) / batch))

    def samples(self, epoch: int) -> Samples:
        if epoch != self._epoch:
            self._samples, self._epoch = self.build(epoch), epoch
        return self._samples

    def at(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        epoch, k = divmod(step, self.per_epoch)
        s = self.samples(epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(s))
        rows = order[[(k * self.batch + i) % len(s) for i in range(self.batch)]]
        return s.tokens[rows], s.weights[rows]


def _state(model: Adapted) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.loras.state_dict().items()}


def train(model: Adapted, stream: Stream, heldout: Samples, *, steps: int, lr: float, device: str,
          eval_every: int, patience: int, eval_batch: int, checkpoint: Path | None = None,
          fingerprint: dict | None = None, progress: Callable[[dict], None] | None = None,
          bar: bool = True) -> tuple[History, dict[str, Any]]:
    """Train; returns the history and the best adapter's state (module docstring)."""
    from tqdm import tqdm

    params = model.trainable()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm
        else 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, steps - warm)))))
    hist, best_state, start = History(), _state(model), 0
    resumed = _resume(checkpoint, fingerprint, model, opt, sched) if checkpoint else None
    if resumed is not None:
        hist, best_state, start = resumed
    else:
        hist.best = evaluate(model, heldout, eval_batch, device)
        hist.evals.append((0, hist.best))
    stale = sum(1 for s, _ in hist.evals if s > hist.best_step)
    t0, tokens0 = time.perf_counter(), hist.tokens
    pb = tqdm(total=steps, initial=start, desc="tuning", unit="step", disable=not bar, dynamic_ncols=True)
    model.train()
    step = start
    report = progress or (lambda _ev: None)
    # LoRA dropout draws from torch's global generator (the one gradient checkpointing saves and
    # restores for its recomputation): seeded from the run's seed and the step, so a run gives the
    # same adapter every time and a resumed run the same as an uninterrupted one, whatever the
    # process drew before; forked, so the caller's generator is left as it was
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        try:
            while step < steps:
                torch.manual_seed(stream.seed * 1_000_003 + step)
                x, w = stream.at(step)
                x, w = torch.from_numpy(x).to(device), torch.from_numpy(w).to(device)
                with autocast(device):
                    s, c = token_losses(model, x, w)
                loss = s / c.clamp_min(1.0)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                step += 1
                hist.losses.append(float(loss.detach()))
                hist.tokens += int(c)
                rate = (hist.tokens - tokens0) / max(time.perf_counter() - t0, 1e-9)
                pb.update(1)
                pb.set_postfix(loss=f"{np.mean(hist.losses[-10:]):.3f}", tok_s=f"{rate:.0f}",
                               heldout=f"{hist.evals[-1][1]:.3f}")
                report({"step": step, "steps": steps, "loss": hist.losses[-1], "tokens_per_s": rate})
                if step % eval_every == 0 or step == steps:
                    h = evaluate(model, heldout, eval_batch, device)
                    hist.evals.append((step, h))
                    if h < hist.best * (1 - MIN_GAIN):
                        hist.best, hist.best_step, best_state, stale = h, step, _state(model), 0
                    else:
                        stale += 1
                    report({"step": step, "steps": steps, "heldout": h, "best": hist.best})
                    if checkpoint:
                        _save(checkpoint, fingerprint, step, model, opt, sched, hist, best_state)
                    if patience and stale >= patience:
                        hist.stopped = "early"
                        break
        except KeyboardInterrupt:
            hist.stopped = "interrupted"
        finally:
            pb.close()
            hist.seconds += time.perf_counter() - t0
            model.eval()
    return hist, best_state


def _save(path: Path, fingerprint, step, model, opt, sched, hist: History, best_state) -> None:
    state = {"fingerprint": fingerprint, "step": step, "lora": _state(model), "opt": opt.state_dict(),
             "sched": sched.state_dict(), "hist": hist.__dict__, "best_state": best_state}
    with atomic_path(path, force=True) as tmp:
        torch.save(state, tmp)


def _resume(path: Path, fingerprint, model, opt, sched):
    """(history, best state, step) from a checkpoint of the same settings, or None."""
    if not path.is_file():
        return None
    try:
        st = torch.load(path, weights_only=False, map_location="cpu")
        if st.get("fingerprint") != fingerprint:
            return None
        model.loras.load_state_dict(st["lora"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        hist = History(**st["hist"])
        hist.stopped = "done"
        return hist, st["best_state"], int(st["step"])
    except (OSError, RuntimeError, KeyError, ValueError, EOFError, TypeError):
        return None
