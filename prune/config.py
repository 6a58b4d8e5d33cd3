"""Pruning settings: `PruneConfig`, the settings of one run, with their defaults and checks.

Each field's default, bounds and help are its declaration in settings.py, so `a3b prune`,
`cached_variant`, the A3B Prune node and the benchmarks agree on them (and so on a variant's cache
key). Importing it does not import torch.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..runtime.options import cache_root
from .textfiles import dir_digest
from .device import resolve_device
from .errors import InvalidRequest
from .settings import (ALIGN, BY_NAME, CALIB_DIRS, CALIB_FILES, CALIB_WINDOWS, CALIBRATION, DATA_FREE, DEVICE,
                       EXPERT_METHOD, EXPERT_METHODS, EXPERTS_KEEP, GATE_SPARSITY, GATE_WINDOWS, GPU_RECOVERY,
                       GRAM_BUDGET_MB, HEADS_KEEP, KEEP, LR, METHOD, METHODS, N_GPU_LAYERS, QAT, RECOVER_BATCH,
                       RECOVER_CODE_SHARE, RECOVER_CORPUS, RECOVER_SEQ_LEN, RECOVER_STEPS, RECOVER_TRAIN_OPTION, SEED,
                       SEQ_LEN, THREADS, check_paths, check_setting)

__all__ = ["DATA_FREE", "EXPERTS_KEEP", "EXPERT_METHODS", "GPU_RECOVERY", "HEADS_KEEP", "KEEP", "METHODS",
           "PruneConfig", "default_cache_dir", "refuse_torch_parts", "with_device_defaults"]


def default_cache_dir() -> Path:
    return cache_root() / "prune"


# Settings added after variants were cached: at their defaults they leave the key (and so the cached
# files' names) as it was, since the defaults reproduce what those files were made with.
_KEY_NEUTRAL_AT_DEFAULT = ("recover_code_share", "heads_keep", "calibration", "calib_dirs", "recover_corpus",
                           "experts_keep", "expert_method")
# Settings that change where or how fast the work runs, not what it makes.
_NOT_IN_KEY = ("threads", "device", "n_gpu_layers", "gram_budget_mb")


def with_device_defaults(settings: dict) -> dict:
    """`settings` (PruneConfig fields; None or absent = unset) with GPU_RECOVERY filled in for the unset
    ones where recovery will run on a CUDA GPU (`device` auto or cuda and torch sees one). Where nothing
    is pruned (keep and heads_keep 1) nothing is recovered: no device is looked for."""
    def given(name: str):
        v = settings.get(name)
        return BY_NAME[name].default if v is None else v

    unset = [k for k in GPU_RECOVERY if settings.get(k) is None]
    if (not unset or settings.get("recover_steps") == 0 or given("device") == "cpu"
            or (given("keep") >= 1.0 and given("heads_keep") >= 1.0)):
        return settings
    try:
        device = resolve_device(given("device"))
    except ImportError:
        return settings  # no torch: the pipeline says so where recovery needs it
    if device != "cuda":
        return settings
    return {**settings, **{k: GPU_RECOVERY[k] for k in unset}}


@dataclass
class PruneConfig:
    """The settings of one pruning run; each field is its declaration in settings.py."""

    keep: float = KEEP.default
    method: str = METHOD.default
    heads_keep: float = HEADS_KEEP.default
    recover_steps: int = RECOVER_STEPS.default
    calib_windows: int = CALIB_WINDOWS.default
    seq_len: int = SEQ_LEN.default
    recover_seq_len: int = RECOVER_SEQ_LEN.default
    recover_batch: int = RECOVER_BATCH.default
    recover_train: str = RECOVER_TRAIN_OPTION.default
    recover_code_share: float = RECOVER_CODE_SHARE.default
    qat: bool = QAT.default
    lr: float = LR.default
    seed: int = SEED.default
    gate_sparsity: float = GATE_SPARSITY.default
    gate_windows: int = GATE_WINDOWS.default
    align: int | None = ALIGN.default
    calib_files: tuple[str, ...] = CALIB_FILES.default
    calib_dirs: tuple[str, ...] = CALIB_DIRS.default
    threads: int = THREADS.default
    calibration: str = CALIBRATION.default
    device: str = DEVICE.default
    n_gpu_layers: int = N_GPU_LAYERS.default
    gram_budget_mb: int | None = GRAM_BUDGET_MB.default
    recover_corpus: str = RECOVER_CORPUS.default
    # mixture-of-experts models (experts/): the share of routed experts kept in every layer, and how
    # they are ranked; `keep` then narrows every kept expert's FFN
    experts_keep: float = EXPERTS_KEEP.default
    expert_method: str = EXPERT_METHOD.default

    def validate(self) -> None:
        """InvalidRequest naming the first setting its declaration refuses, or a calibration path not there."""
        for f in fields(self):
            check_setting(BY_NAME[f.name], getattr(self, f.name))
        check_paths(self.calib_files, self.calib_dirs)

    def key(self) -> str:
        """Hash of every setting that shapes the output (threads do not), naming cached files."""
        d = asdict(self)
        for name in _NOT_IN_KEY:
            d.pop(name)
        for name in _KEY_NEUTRAL_AT_DEFAULT:
            if d[name] == getattr(PruneConfig, name):
                d.pop(name)
        d["calib_files"] = [hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in self.calib_files]
        if "calib_dirs" in d:
            d["calib_dirs"] = [dir_digest(x) for x in self.calib_dirs]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def refuse_torch_parts(cfg: PruneConfig, where: str, *, recovery: bool = True) -> None:
    """InvalidRequest where `cfg` asks a path without the torch reference forward (`where` names it)
    for what only that forward does: head pruning, and recovery (unless `recovery` is False: the
    caller then leaves recovery out on its own)."""
    if cfg.heads_keep < 1.0:
        raise InvalidRequest(f"head pruning runs on the torch reference forward (llama, qwen3), which {where}; "
                             "use --heads-keep 1 (or --calibration torch for a llama or qwen3 model).")
    if recovery and cfg.recover_steps > 0 and (cfg.keep < 1.0 or cfg.experts_keep < 1.0):
        raise InvalidRequest(f"recovery by distillation runs on the torch reference forward, which {where}: "
                             "pruning here is one-shot. Pass --recover-steps 0.")
