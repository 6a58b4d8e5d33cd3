"""The training loop on a tiny random model (torch, a few seconds): the adapter starts at the base,
gradient checkpointing changes nothing, early stopping, Ctrl-C keeps the best, a run resumes."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

from comfyui_a3b.bench.bench_gpu_tune import hparams  # noqa: E402
from comfyui_a3b.tune.lora import Adapted, token_losses  # noqa: E402
from comfyui_a3b.tune.model import random_base  # noqa: E402
from comfyui_a3b.tune.options import TARGETS  # noqa: E402
from comfyui_a3b.tune.samples import Samples  # noqa: E402
from comfyui_a3b.tune.train import Stream, train  # noqa: E402


def _model(ckpt=False):
    return Adapted(random_base(hparams("tiny"), "cpu", seed=3), list(TARGETS), 4, 8.0, 0.0, seed=1, checkpoint=ckpt)


def _samples(n, seed):
    rng = np.random.default_rng(seed)
    # a planted regularity: token t is followed by t + 1 (mod 64)
    start = rng.integers(0, 64, size=(n, 1))
    toks = (start + np.arange(32)[None]) % 64
    w = np.ones((n, 32), dtype=np.float32)
    w[:, -1] = 0
    return Samples(toks.astype(np.int64), w, ["plain"] * n)


def _run(model, steps, **kw):
    train_s = _samples(32, 0)
    kw = {"lr": 3e-2, "device": "cpu", "eval_every": 2, "patience": 0, "eval_batch": 8, "bar": False, **kw}
    return train(model, Stream(lambda e: train_s, 4, 0), _samples(8, 1), steps=steps, **kw)


def test_the_adapter_starts_at_the_base_and_checkpointing_changes_nothing():
    m = _model()
    x = torch.from_numpy(_samples(2, 5).tokens)
    with torch.no_grad():
        adapted = m(x)
        m.detach()
        plain = m(x)
        m.attach()
    assert torch.equal(adapted, plain)
    for lora in m.loras.values():   # a non-zero update, so that gradients reach A too
        torch.nn.init.normal_(lora.b, std=0.1)
    grads = []
    for ckpt in (False, True):
        m.checkpoint = ckpt
        m.train()
        m.zero_grad()
        s, c = token_losses(m, x, torch.ones_like(x, dtype=torch.float32))
        (s / c).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.trainable()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_training_lowers_the_held_out_loss_and_stops_early():
    hist, best = _run(_model(), 12)
    assert hist.stopped == "done" and len(hist.evals) == 7
    assert hist.best < 0.7 * hist.base_loss
    hist2, _ = _run(_model(), 40, lr=1e-9, patience=2)      # nothing to gain: stops after two evaluations
    assert hist2.stopped == "early" and hist2.evals[-1][0] == 4


def test_ctrl_c_keeps_the_best_adapter_and_a_run_resumes(tmp_path):
    ckpt = tmp_path / "a.gguf.ckpt"
    fp = {"run": 1}

    def stop_at(n):
        def progress(ev):
            if ev.get("step") == n and "heldout" not in ev:
                raise KeyboardInterrupt
        return progress
    m = _model()
    hist, best = _run(m, 10, checkpoint=ckpt, fingerprint=fp, progress=stop_at(5))
    assert hist.stopped == "interrupted" and len(hist.losses) == 5
    assert hist.best_step == 4 and ckpt.is_file()
    state = {k: v.clone() for k, v in m.loras.state_dict().items()}
    assert any(not torch.equal(best[k], state[k]) for k in best)    # the best, not the last step's state
    m2 = _model()
    seen: list[int] = []
    hist2, _ = _run(m2, 10, checkpoint=ckpt, fingerprint=fp, progress=lambda ev: seen.append(ev["step"]))
    assert hist2.stopped == "done" and len(hist2.losses) == 10
    assert min(seen) == 5                                         # steps 5..10 after the checkpoint at 4
    assert hist2.evals[:3] == hist.evals[:3]
    m3 = _model()
    hist3, _ = _run(m3, 10, checkpoint=ckpt, fingerprint={"run": 2})   # other settings: from the start
    assert hist3.evals[0][0] == 0 and len(hist3.losses) == 10


def test_dropout_is_seeded_by_the_run_not_by_what_the_process_drew_before():
    def dropout_model():
        return Adapted(random_base(hparams("tiny"), "cpu", seed=3), list(TARGETS), 4, 8.0, 0.3, seed=1)

    adapters = []
    for before in (0, 12345):
        torch.manual_seed(before)           # whatever the process drew before the run
        m = dropout_model()
        _run(m, 4)
        adapters.append(m.loras.state_dict())
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    _run(dropout_model(), 2)
    assert torch.equal(torch.rand(3), want)   # the caller's generator is left as it was
