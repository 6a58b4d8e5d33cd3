"""`a3b tune DIR --model MODEL`: from a repository to a GGUF LoRA adapter, checked before any work.

Order: the options (TuneConfig), the output path (writable), the base (an architecture the torch
forward knows, and memory enough for it, both before loading), the repository's files and their
split, the model's tokenizer and the samples, then the base dequantised once (frozen: float32 on
the CPU, bf16 on a GPU), training, and the adapter written from the best state.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

from ..runtime.models import adapters as keys
from .collect import collect, split
from .errors import NoSources, NotEnoughMemory, UnsupportedArchitecture
from .options import TuneConfig

log = logging.getLogger("comfyui_a3b.tune")

#: The architectures prune/'s torch reference forward computes (prune/source.py).
KNOWN = ("llama", "qwen2", "qwen3")
#: At most this many held-out samples are evaluated (a seeded choice), so an evaluation costs
#: about as much as a few training steps on a large repository.
MAX_EVAL_SAMPLES = 48


@dataclass
class TuneResult:
    adapter: Path
    heldout_loss_base: float
    heldout_loss: float
    steps: int
    best_step: int
    stopped: str
    tokens: int
    seconds: float
    train_files: int
    heldout_files: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Held-out perplexity of the adapter over the base's."""
        return math.exp(self.heldout_loss - self.heldout_loss_base)


def default_out(model_path: Path, repo: Path) -> Path:
    return Path.cwd() / f"{repo.name or 'repo'}.{model_path.stem}.lora.gguf"


def _check_arch(path: Path) -> None:
    from ..runtime.models.gguf_info import inspect_gguf

    arch = inspect_gguf(path).architecture
    if arch not in KNOWN:
        raise UnsupportedArchitecture(
            f"{path.name} is a {arch!r} model; the tuner's torch forward knows {', '.join(KNOWN)}. Tune a base "
            "of one of those (SmolLM2 and Llama 3 are llama; Qwen2.5-Coder is qwen2; Qwen3 is qwen3), or train "
            "the LoRA elsewhere (PEFT on the original weights) and convert it with llama.cpp's "
            "convert_lora_to_gguf.py.")


def needed_bytes(path: Path, cfg: TuneConfig, device: str) -> int:
    """Memory training takes: the dequantised base, and activations for one batch (an estimate)."""
    from ..prune.source import SourceModel

    src = SourceModel(path)
    hp = src.hp
    n = sum(int(math.prod(t.shape)) for t in src.tensors.values())
    per = 2 if device == "cuda" else 4
    tokens = cfg.batch * cfg.seq_len
    width = 12 * hp.n_embd + 4 * hp.n_ff + 2 * hp.n_head * cfg.seq_len // max(1, 8)
    layers = 2 if cfg.grad_checkpointing else hp.n_layer
    acts = tokens * width * 4 * layers + tokens * hp.n_embd * 4 * hp.n_layer
    logits = tokens * hp.n_vocab * 4 * 3
    return n * per + acts + logits


def _available(device: str) -> int:
    if device == "cuda":
        from ..prune.errors import require_torch

        free, _ = require_torch().cuda.mem_get_info()
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def check_memory(path: Path, cfg: TuneConfig, device: str) -> None:
    need, have = needed_bytes(path, cfg, device), _available(device)
    if need > have:
        where = "GPU memory" if device == "cuda" else "main memory"
        raise NotEnoughMemory(
            f"tuning {path.name} needs about {need / 2**30:.1f} GiB of {where} (the base dequantised, and one batch "
            f"of {cfg.batch} x {cfg.seq_len} tokens); {have / 2**30:.1f} GiB is free. Use --batch 1, a smaller "
            "--seq-len, --grad-checkpointing, a GPU (--device cuda), or a smaller base.")


def tune(repo: str | os.PathLike, model: str | os.PathLike, out: str | os.PathLike | None = None,
         cfg: TuneConfig | None = None, *, resume: bool = True, bar: bool = True,
         progress: Callable[[dict], None] | None = None, max_eval_samples: int = MAX_EVAL_SAMPLES) -> TuneResult:
    from ..prune.device import resolve_device
    from ..runtime.models.locate import resolve_model
    from .adapter import check_writable

    cfg = cfg or TuneConfig()
    base = Path(resolve_model(model)).resolve()
    root = Path(repo).expanduser().resolve()
    out = check_writable(out or default_out(base, root))
    _check_arch(base)
    device = resolve_device(cfg.device)
    check_memory(base, cfg, device)
    coll = collect(root, cfg.max_file_kb * 1024)
    parts = split(coll.files, cfg.holdout, cfg.seed)
    log.info("tune: %d files (%d held out), %d characters; skipped %s", len(coll.files), len(parts.heldout),
             coll.chars, coll.skipped)
    return _train(base, coll, parts, out, cfg, device, resume=resume, bar=bar, progress=progress,
                  max_eval_samples=max_eval_samples)


def _train(base, coll, parts, out, cfg, device, *, resume, bar, progress, max_eval_samples) -> TuneResult:
    import numpy as np

    from ..prune.source import SourceModel
    from ..runtime.llama.weights import Weights
    from . import adapter as writer
    from .model import load_base
    from .lora import Adapted
    from .samples import Builder, Samples, Tokenizer
    from .train import Stream, train

    vocab = Weights(base, vocab_only=True)
    try:
        tok = Tokenizer.from_vocab(vocab)
        builder = Builder(tok, cfg.seq_len, cfg.fim_rate, cfg.seed, cfg.docstring_pairs)
        first = builder.build(parts.train, 0)
        if not len(first):
            raise NoSources(f"the training files of {coll.root} give no samples (each is under two tokens).")
        held = builder.build(parts.heldout, 0)
        if len(held) > max_eval_samples:
            keep = np.sort(np.random.default_rng(cfg.seed).choice(len(held), max_eval_samples, replace=False))
            held = Samples(held.tokens[keep], held.weights[keep], [held.kinds[i] for i in keep])
        cache = {0: first}
        stream = Stream(lambda e: cache.pop(e, None) or builder.build(parts.train, e), cfg.batch, cfg.seed)
    except BaseException:
        vocab.free()
        raise
    src = SourceModel(base)
    steps = cfg.steps or cfg.epochs * stream.per_epoch
    model = Adapted(load_base(src, device), cfg.target_list, cfg.rank, cfg.alpha, cfg.dropout, cfg.seed,
                    cfg.grad_checkpointing)
    fingerprint = {"base": src.sha256, "split": parts.record(), "config": cfg.as_dict(), "steps": steps}
    ckpt = out.with_name(out.name + ".ckpt")
    if not resume and ckpt.exists():
        ckpt.unlink()
    try:   # later epochs build their samples with the tokenizer
        hist, best = train(model, stream, held, steps=steps, lr=cfg.lr, device=device, eval_every=cfg.eval_every,
                           patience=cfg.patience, eval_batch=max(1, cfg.batch), checkpoint=ckpt,
                           fingerprint=fingerprint, progress=progress, bar=bar)
    finally:
        vocab.free()
    model.loras.load_state_dict(best)
    meta = {keys.BASE_SHA256: src.sha256, keys.BASE_NAME: base.name, keys.REPO: str(coll.root),
            keys.COMMIT: (coll.commit or "") + ("+dirty" if coll.dirty else ""), keys.SPLIT: parts.record(),
            keys.HELDOUT_BASE: hist.base_loss, keys.HELDOUT: hist.best, keys.CONFIG: cfg.as_dict(),
            "a3b.tune.steps": len(hist.losses), "a3b.tune.best_step": hist.best_step,
            "a3b.tune.stopped": hist.stopped, "a3b.tune.samples": (builder.layout if cfg.fim_rate else "plain")
            + ("+pairs" if cfg.docstring_pairs else "")}
    writer.write(out, src.hp.arch, cfg.alpha, model.tensors(), meta)
    if hist.stopped != "interrupted" and ckpt.exists():
        ckpt.unlink()
    return TuneResult(out, hist.base_loss, hist.best, len(hist.losses), hist.best_step, hist.stopped, hist.tokens,
                      hist.seconds, len(parts.train), len(parts.heldout), meta)
