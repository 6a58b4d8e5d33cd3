"""The tuner's options, each declared once (type, default, bounds, help) as a runtime `Option`.

`a3b tune`'s flags, the checks of `TuneConfig` and the language server's tune command read these.
The LoRA defaults are the usual ones for code adapters: rank 8, alpha 16 (a scale of 2 over the
low-rank product), dropout 0.05 on the adapter's input, on every matrix of every block.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..prune.device import DEVICES
from ..runtime.options import Option, check

#: The matrices an adapter may train, by their GGUF names inside a block.
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

RANK = Option("rank", int, 8, "Rank of the LoRA update: the width of the low-rank product added to each matrix.",
              min=1, max=1024)
ALPHA = Option("alpha", float, 16.0, "Alpha of the LoRA update, which is scaled by alpha / rank.", min=0.0, max=1e4,
               low_open=True)
DROPOUT = Option("dropout", float, 0.05, "Dropout on the adapter's input while training.", min=0.0, max=1.0,
                 high_open=True)
TARGET = Option("targets", str, ",".join(TARGETS),
                f"Matrices the adapter trains, comma-separated, from {', '.join(TARGETS)}.")
EPOCHS = Option("epochs", int, 3, "Passes over the training files (--steps, when given, counts instead).",
                min=1, max=1000)
STEPS = Option("steps", int, None, "Optimiser steps; counts instead of --epochs.", min=1, max=10**7, nullable=True)
LR = Option("lr", float, 2e-4, "Learning rate of the adapter (AdamW, cosine decay after a short warm-up).",
            min=0.0, max=1.0, low_open=True)
BATCH = Option("batch", int, 4, "Samples per optimiser step.", min=1, max=4096)
SEQ_LEN = Option("seq_len", int, 512, "Tokens per training sample.", min=32, max=1 << 17)
HOLDOUT = Option("holdout", float, 0.1, "Share of the files held out to measure the adapter (at least 3 files).",
                 min=0.0, max=0.5, low_open=True)
SEED = Option("seed", int, 0, "Seed of the split, the samples and the adapter's initial values.", min=0,
              max=2**31 - 1)
FIM_RATE = Option("fim_rate", float, 0.5, "Share of samples laid out as the editor's completion prompts: "
                  "fill-in-the-middle for models with FIM tokens, the file header and the text before a cursor "
                  "otherwise; the rest are plain windows of the files.", min=0.0, max=1.0)
DOCSTRING_PAIRS = Option("docstring_pairs", bool, False, "Also learn each documented Python function's body "
                         "from its signature and docstring (one more sample per function).")
EVAL_EVERY = Option("eval_every", int, 50, "Steps between held-out evaluations.", min=1, max=10**6)
PATIENCE = Option("patience", int, 3, "Evaluations without a better held-out loss before stopping early; "
                  "0 = never stop early.", min=0, max=10**6)
DEVICE = Option("device", str, "auto", "Where training runs: the GPU when torch sees one (auto), cpu or cuda.",
                choices=DEVICES)
CHECKPOINTING = Option("grad_checkpointing", bool, False,
                       "Recompute each block's activations in the backward pass: less memory, about a third "
                       "more time.")
MAX_FILE_KB = Option("max_file_kb", int, 256, "Larger files are left out.", min=1, max=1 << 20)

OPTIONS = (RANK, ALPHA, DROPOUT, TARGET, EPOCHS, STEPS, LR, BATCH, SEQ_LEN, HOLDOUT, SEED, FIM_RATE,
           EVAL_EVERY, PATIENCE, DEVICE, CHECKPOINTING, MAX_FILE_KB, DOCSTRING_PAIRS)


@dataclass
class TuneConfig:
    rank: int = RANK.default
    alpha: float = ALPHA.default
    dropout: float = DROPOUT.default
    targets: str = TARGET.default
    epochs: int = EPOCHS.default
    steps: int | None = STEPS.default
    lr: float = LR.default
    batch: int = BATCH.default
    seq_len: int = SEQ_LEN.default
    holdout: float = HOLDOUT.default
    seed: int = SEED.default
    fim_rate: float = FIM_RATE.default
    eval_every: int = EVAL_EVERY.default
    patience: int = PATIENCE.default
    device: str = DEVICE.default
    grad_checkpointing: bool = CHECKPOINTING.default
    max_file_kb: int = MAX_FILE_KB.default
    docstring_pairs: bool = DOCSTRING_PAIRS.default

    def __post_init__(self) -> None:
        by_name = {o.name: o for o in OPTIONS}
        for f in fields(self):
            setattr(self, f.name, check(by_name[f.name], getattr(self, f.name), "--" + f.name.replace("_", "-")))
        names = [t.strip() for t in self.targets.split(",") if t.strip()]
        bad = [t for t in names if t not in TARGETS]
        if bad or not names:
            from .errors import InvalidRequest

            raise InvalidRequest(f"--targets: unknown {', '.join(bad) or 'empty list'}; choose from "
                                 f"{', '.join(TARGETS)}.")
        self.targets = ",".join(t for t in TARGETS if t in names)

    @property
    def target_list(self) -> list[str]:
        return self.targets.split(",")

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
