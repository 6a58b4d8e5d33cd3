"""Pruning settings: `PruneConfig` is the one place for their defaults and checks.

`a3b prune`, `cached_variant`, the A3BLoader node and the benchmarks all take their defaults from
here, so the settings a variant was made with (and so its cache key) agree everywhere. Importing
it does not import torch.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..runtime.options import Option, cache_root, check, check_finite
from .corpus import dir_digest
from .device import DEVICES, resolve_device
from .errors import InvalidRequest

#: FFN-neuron importance methods (dense/methods.py says what each does), and those that need no data
METHODS = ("random", "magnitude", "wanda", "flap", "obs", "a3b")
DATA_FREE = ("random", "magnitude")


def default_cache_dir() -> Path:
    return cache_root() / "prune"


# Settings added after variants were cached: at their defaults they leave the key (and so the cached
# files' names) as it was, since the defaults reproduce what those files were made with.
_KEY_NEUTRAL_AT_DEFAULT = ("recover_code_share", "heads_keep", "calibration", "calib_dirs", "recover_corpus",
                           "experts_keep", "expert_method")
# Settings that change where or how fast the work runs, not what it makes.
_NOT_IN_KEY = ("threads", "device", "n_gpu_layers", "gram_budget_mb")

CALIBRATIONS = ("auto", "llama", "torch")
#: How whole experts of a mixture-of-experts model are ranked (experts.py).
EXPERT_METHODS = ("reap", "frequency", "random")
RECOVER_CORPORA = ("calib", "wide")


#: Recovery where the torch parts run on a CUDA GPU, for the settings a caller leaves unset
#: (PruneConfig's own defaults are the CPU's): the setting measured to reach the recovery targets on
#: SmolLM2-135M, on code and on prose from another source (docs/pruning.md); about 8 minutes on an H200.
GPU_RECOVERY = {"recover_steps": 2000, "recover_batch": 32, "recover_seq_len": 512, "recover_corpus": "wide"}


def with_device_defaults(settings: dict) -> dict:
    """`settings` (PruneConfig fields; None or absent = unset) with GPU_RECOVERY filled in for the unset
    ones where recovery will run on a CUDA GPU (`device` auto or cuda and torch sees one). Where nothing
    is pruned (keep and heads_keep 1) nothing is recovered: no device is looked for."""
    def given(name: str):
        v = settings.get(name)
        return getattr(PruneConfig, name) if v is None else v

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


#: The keep ratios, declared once: PruneConfig checks them, and the A3BLoader's widgets (where 1 means
#: no pruning) take their bounds.
KEEP = Option("keep", float, 0.63, "Fraction of the FFN neurons kept in every layer.", min=0.0, low_open=True,
              max=1.0, step=0.05, label="keep ratio",
              hint="it is the fraction of FFN neurons kept in every layer (e.g. 0.63).")
HEADS_KEEP = Option("heads_keep", float, 1.0, "Fraction of the query heads of every KV group kept.", min=0.0,
                    low_open=True, max=1.0, step=0.01, label="heads keep ratio",
                    hint="it is the fraction of query heads kept in every KV group (e.g. 0.67 keeps 2 of 3).")
EXPERTS_KEEP = Option("experts_keep", float, 1.0, "Fraction of the routed experts kept in every layer of a "
                      "mixture-of-experts model.", min=0.0, low_open=True, max=1.0, step=0.05,
                      label="experts keep ratio", hint="it is the fraction of routed experts kept in every "
                      "layer of a mixture-of-experts model (e.g. 0.5).")


@dataclass
class PruneConfig:
    keep: float = KEEP.default
    method: str = "a3b"
    heads_keep: float = HEADS_KEEP.default   # fraction of the query heads of every KV group kept (heads.py)
    recover_steps: int = 160   # the measured setting (docs/pruning.md); the A3BLoader's default too
    calib_windows: int = 64
    seq_len: int = 256
    recover_seq_len: int = 128
    recover_batch: int = 8
    recover_train: str = "all"
    recover_code_share: float = 0.5
    qat: bool = True
    lr: float = 5e-4
    seed: int = 0
    gate_sparsity: float = 0.5
    gate_windows: int = 8
    align: int | None = None
    calib_files: tuple[str, ...] = ()
    calib_dirs: tuple[str, ...] = ()
    threads: int = 0
    # where the statistics come from: llama.cpp's graph evaluation (any architecture it runs, streamed,
    # bounded memory), the torch reference forward (llama/qwen2/qwen3; sequential a3b, recovery, head
    # pruning), or auto (torch where one of those needs it, else llama.cpp)
    calibration: str = "auto"
    device: str = "auto"          # torch parts: cuda, cpu or auto
    n_gpu_layers: int = 0         # llama.cpp calibration: layers offloaded to the GPU (-1: all)
    # memory for the Gram matrices held during a llama.cpp calibration pass; None: half the model
    # file (dense/llama_path.py), so that the run's memory follows the model's size
    gram_budget_mb: int | None = None
    recover_corpus: str = "calib"  # recovery text: the calibration corpus, or the wide corpus (corpus.py)
    # mixture-of-experts models (experts.py): the share of routed experts kept in every layer, and how
    # they are ranked; `keep` then narrows every kept expert's FFN
    experts_keep: float = EXPERTS_KEEP.default
    expert_method: str = "reap"

    def validate(self) -> None:
        for name in ("lr", "gate_sparsity", "recover_code_share"):  # keep ratios: range checks below
            check_finite(name.replace("_", " "), getattr(self, name))
        for option in (KEEP, HEADS_KEEP, EXPERTS_KEEP):
            check(option, getattr(self, option.name))
        if self.expert_method not in EXPERT_METHODS:
            raise InvalidRequest(f"unknown expert ranking {self.expert_method!r}; choose one of "
                                 f"{', '.join(EXPERT_METHODS)}")
        if not self.lr > 0:
            raise InvalidRequest(f"learning rate must be > 0, got {self.lr}")
        if self.method not in METHODS:
            raise InvalidRequest(f"unknown pruning method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.recover_steps < 0:
            raise InvalidRequest(f"recover steps must be >= 0, got {self.recover_steps}")
        if self.recover_train not in ("all", "ffn"):
            raise InvalidRequest(f"recovery trains 'all' or 'ffn', got {self.recover_train!r}")
        if not 0.0 < self.recover_code_share < 1.0:
            raise InvalidRequest(f"the code share of recovery batches must be in (0, 1), got {self.recover_code_share}")
        if self.recover_batch < 1 or self.recover_seq_len < 8:
            raise InvalidRequest("recovery needs batches of at least 1 window of at least 8 tokens")
        if self.calib_windows < 1 or self.seq_len < 8:
            raise InvalidRequest("calibration needs at least 1 window of at least 8 tokens")
        if not 0.0 <= self.gate_sparsity < 1.0:
            raise InvalidRequest(f"gate sparsity must be in [0, 1), got {self.gate_sparsity}")
        for f in self.calib_files:
            if not Path(f).is_file():
                raise InvalidRequest(f"calibration file not found: {f}")
        for d in self.calib_dirs:
            if not Path(d).is_dir():
                raise InvalidRequest(f"calibration folder not found: {d}")
        if self.calibration not in CALIBRATIONS:
            raise InvalidRequest(f"calibration is one of {', '.join(CALIBRATIONS)}, got {self.calibration!r}")
        if self.recover_corpus not in RECOVER_CORPORA:
            raise InvalidRequest(f"recovery corpus is one of {', '.join(RECOVER_CORPORA)}, got {self.recover_corpus!r}")
        if self.device not in DEVICES:
            raise InvalidRequest(f"device is one of {', '.join(DEVICES)}, got {self.device!r}")
        if not isinstance(self.n_gpu_layers, int) or self.n_gpu_layers < -1:
            raise InvalidRequest("n_gpu_layers must be -1 (all), 0 (CPU only) or a layer count, "
                                 f"got {self.n_gpu_layers!r}")
        if self.gram_budget_mb is not None and (isinstance(self.gram_budget_mb, bool) or self.gram_budget_mb < 1):
            raise InvalidRequest(f"gram budget must be at least 1 MB, got {self.gram_budget_mb}")

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
