"""Every pruning setting, declared once as a runtime `Option`: default, bounds or choices, help.

`PruneConfig` (config.py) takes its field defaults and its checks from these declarations, `a3b
prune` (cli.py) builds its flags from them, and the A3B Prune node its widgets (nodes/defs.py). The
one rule that ties recovery to expert pruning lives here too (`recover_steps_for`). Importing this
module imports neither torch nor the pipeline.
"""
from __future__ import annotations

import os
from typing import Any

from ..runtime.options import Option, check, check_finite
from .device import DEVICES
from .errors import InvalidRequest

#: FFN-neuron importance methods (dense/methods.py says what each does), and those that need no data
METHODS = ("random", "magnitude", "wanda", "flap", "obs", "a3b")
DATA_FREE = ("random", "magnitude")
#: Where the statistics come from: llama.cpp's graph evaluation (any architecture it runs, streamed,
#: bounded memory), the torch reference forward (llama/qwen2/qwen3; sequential a3b, recovery, head
#: pruning), or auto (torch where one of those needs it, else llama.cpp).
CALIBRATIONS = ("auto", "llama", "torch")
#: How whole experts of a mixture-of-experts model are ranked (experts/plan.py).
EXPERT_METHODS = ("reap", "frequency", "random")
#: Recovery text: the calibration corpus, or the wide corpus (corpus.py).
RECOVER_CORPORA = ("calib", "wide")
#: What distillation trains.
RECOVER_TRAIN = ("all", "ffn")

# The keep ratios: the A3B Prune node's widgets take their bounds (1 there means no pruning).
KEEP = Option("keep", float, 0.63, "Fraction of FFN neurons kept (of a mixture-of-experts model: in every kept "
              "expert, 1 with --experts-keep) in every layer.", min=0.0, low_open=True, max=1.0, step=0.05,
              label="keep ratio", hint="it is the fraction of FFN neurons kept in every layer (e.g. 0.63).")
EXPERTS_KEEP = Option("experts_keep", float, 1.0, "Mixture-of-experts models (qwen3moe, qwen35moe): fraction of "
                      "the routed experts kept in every layer (--keep then defaults to 1 and --recover-steps to 0).",
                      min=0.0, low_open=True, max=1.0, step=0.05, label="experts keep ratio",
                      hint="it is the fraction of routed experts kept in every layer of a mixture-of-experts model "
                      "(e.g. 0.5).")
EXPERT_METHOD = Option("expert_method", str, "reap", "How experts are ranked: reap (router weight x output norm on "
                       "routed tokens), frequency (tokens routed), random.", choices=EXPERT_METHODS)
METHOD = Option("method", str, "a3b", "Neuron importance method.", choices=METHODS)
HEADS_KEEP = Option("heads_keep", float, 1.0, "Fraction of the query heads of every KV group kept (1 = no head "
                    "pruning).", min=0.0, low_open=True, max=1.0, step=0.01, label="heads keep ratio",
                    hint="it is the fraction of query heads kept in every KV group (e.g. 0.67 keeps 2 of 3).")
#: 160: the measured setting on the CPU (docs/pruning.md); GPU_RECOVERY's where recovery runs on a GPU
RECOVER_STEPS = Option("recover_steps", int, 160, "Distillation steps after pruning, 0 = none; 0 with "
                       "--experts-keep or a mixture-of-experts model.", min=0, label="recover steps")
CALIB_WINDOWS = Option("calib_windows", int, 64, "Calibration windows.", min=1)
SEQ_LEN = Option("seq_len", int, 256, "Tokens per calibration window.", min=8)
CALIB_FILES = Option("calib_files", tuple, (), "Calibrate on this text file instead of the built-in "
                     "standard-library corpus (repeatable; default: the built-in corpus).")
CALIB_DIRS = Option("calib_dirs", tuple, (), "Calibrate (and recover) on the UTF-8 text files under this folder "
                    "(repeatable; default: the built-in corpus).")
CALIBRATION = Option("calibration", str, "auto", "Where statistics come from: llama.cpp's evaluation of the GGUF "
                     "(any supported architecture, streamed), the torch reference forward (llama/qwen2/qwen3: "
                     "sequential a3b, recovery, head pruning), or auto: torch where recovery or head pruning needs "
                     "it, llama.cpp otherwise.", choices=CALIBRATIONS)
DEVICE = Option("device", str, "auto", "Where the torch parts run (recovery, reference statistics, least-squares "
                "fits); auto takes a CUDA GPU when torch sees one.", choices=DEVICES)
N_GPU_LAYERS = Option("n_gpu_layers", int, 0, "llama.cpp calibration: layers offloaded to the GPU, -1 = all, "
                      "0 = CPU only.", min=-1)
#: None: half the model file (dense/llama_path.py), so that the run's memory follows the model's size
GRAM_BUDGET_MB = Option("gram_budget_mb", int, None, "llama.cpp calibration: memory for the Gram matrices (obs, "
                        "a3b) held at once; the other layers' inputs go through files in the cache folder in the "
                        "same pass, or, where its disk lacks the room, through more passes (default: half the "
                        "size of the model file).", min=1, nullable=True)
RECOVER_CORPUS = Option("recover_corpus", str, "calib", "Recovery text: the calibration corpus, or the wide corpus "
                        "of everything installed (the standard library, every package's sources and "
                        "documentation, Debian's documentation).", choices=RECOVER_CORPORA)
LR = Option("lr", float, 5e-4, "Distillation learning rate.", min=0.0, low_open=True, label="learning rate")
RECOVER_BATCH = Option("recover_batch", int, 8, "Windows per distillation step.", min=1)
RECOVER_SEQ_LEN = Option("recover_seq_len", int, 128, "Tokens per distillation window.", min=8)
RECOVER_TRAIN_OPTION = Option("recover_train", str, "all", "Tensors distillation trains: every block tensor (all) "
                              "or only the FFN (ffn).", choices=RECOVER_TRAIN)
RECOVER_CODE_SHARE = Option("recover_code_share", float, 0.5, "Share of code windows in distillation batches, the "
                            "rest prose.", min=0.0, low_open=True, max=1.0, high_open=True,
                            label="the code share of recovery batches")
QAT = Option("qat", bool, True, "Train through llama.cpp's quantiser; off: train in float and quantise once at "
             "the end.")
GATE_SPARSITY = Option("gate_sparsity", float, 0.5, "Target sparsity of the stored dynamic gate.", min=0.0,
                       max=1.0, high_open=True, label="gate sparsity")
GATE_WINDOWS = Option("gate_windows", int, 8, "Calibration windows the dynamic gate's thresholds are measured on.",
                      min=0)
#: None: the block size of the file's FFN down projections (writing/align.py)
ALIGN = Option("align", int, None, "Round the FFN width to a multiple of N (default: the block size of the file's "
               "FFN down projections, so that each keeps its type: 32 for Q4_0, Q4_1, Q8_0, 256 for K-quants, 1 for "
               "float files; a smaller N stores those that cannot hold it in llama-quantize's fallback type).",
               min=1, nullable=True)
SEED = Option("seed", int, 0, "Random seed of the run (random selection, distillation batches, dynamic gate).",
              min=0)
THREADS = Option("threads", int, 0, "Torch / quantiser threads, 0 = all cores.", min=0)

#: every setting, in the order `a3b prune --help` lists them
OPTIONS = (KEEP, EXPERTS_KEEP, EXPERT_METHOD, METHOD, HEADS_KEEP, RECOVER_STEPS, CALIB_WINDOWS, SEQ_LEN, CALIB_FILES,
           CALIB_DIRS, CALIBRATION, DEVICE, N_GPU_LAYERS, GRAM_BUDGET_MB, RECOVER_CORPUS, LR, RECOVER_BATCH,
           RECOVER_SEQ_LEN, RECOVER_TRAIN_OPTION, RECOVER_CODE_SHARE, QAT, GATE_SPARSITY, GATE_WINDOWS, ALIGN, SEED,
           THREADS)
BY_NAME = {o.name: o for o in OPTIONS}

#: Recovery where the torch parts run on a CUDA GPU, for the settings a caller leaves unset (the
#: declarations' defaults are the CPU's): the setting measured to reach the recovery targets on
#: SmolLM2-135M, on code and on prose from another source (docs/pruning.md); about 8 minutes on an H200.
GPU_RECOVERY = {"recover_steps": 2000, "recover_batch": 32, "recover_seq_len": 512, "recover_corpus": "wide"}

#: why recovery is refused with expert pruning (config.refuse_torch_parts says the same of a path's model)
ONE_SHOT = ("recovery by distillation runs on the torch reference forward, which has no mixture-of-experts "
            "architecture: pruning here is one-shot.")

# Refusals in the words users have seen since before the declarations (check's own words otherwise).
_WINDOWS = f"at least {CALIB_WINDOWS.min} window of at least {SEQ_LEN.min} tokens"
_REFUSALS = {
    "calib_windows": lambda v: f"calibration needs {_WINDOWS}",
    "seq_len": lambda v: f"calibration needs {_WINDOWS}",
    "recover_batch": lambda v: f"recovery needs batches of at least {RECOVER_BATCH.min} window of at least "
                               f"{RECOVER_SEQ_LEN.min} tokens",
    "n_gpu_layers": lambda v: f"n_gpu_layers must be -1 (all), 0 (CPU only) or a layer count, got {v!r}",
    "gram_budget_mb": lambda v: f"gram budget must be at least {GRAM_BUDGET_MB.min} MB, got {v}",
}
_REFUSALS["recover_seq_len"] = _REFUSALS["recover_batch"]
for _option, _words in ((METHOD, "unknown pruning method {v!r}; choose one of {choices}"),
                        (EXPERT_METHOD, "unknown expert ranking {v!r}; choose one of {choices}"),
                        (RECOVER_TRAIN_OPTION, "recovery trains {either}, got {v!r}"),
                        (CALIBRATION, "calibration is one of {choices}, got {v!r}"),
                        (RECOVER_CORPUS, "recovery corpus is one of {choices}, got {v!r}"),
                        (DEVICE, "device is one of {choices}, got {v!r}")):
    _REFUSALS[_option.name] = lambda v, o=_option, w=_words: w.format(
        v=v, choices=", ".join(o.choices), either=" or ".join(map(repr, o.choices)))
#: floats whose NaN or infinity is named by the field's words before their bounds are checked
_FINITE_FIRST = (LR, GATE_SPARSITY, RECOVER_CODE_SHARE)


def check_setting(option: Option, value: Any) -> Any:
    """`value` if the pruning setting `option` takes it, else InvalidRequest saying what is taken."""
    if option in (CALIB_FILES, CALIB_DIRS):   # paths, checked where they are read (PruneConfig.validate)
        return value
    if option in _FINITE_FIRST:
        check_finite(option.name.replace("_", " "), value)
    words = _REFUSALS.get(option.name)
    return check(option, value, error=InvalidRequest if words is None else lambda _: InvalidRequest(words(value)))


def check_paths(calib_files: tuple[str, ...], calib_dirs: tuple[str, ...]) -> None:
    """InvalidRequest naming the first calibration file or folder that is not there."""
    for f in calib_files:
        if not os.path.isfile(f):
            raise InvalidRequest(f"calibration file not found: {f}")
    for d in calib_dirs:
        if not os.path.isdir(d):
            raise InvalidRequest(f"calibration folder not found: {d}")


def recover_steps_for(recover_steps: int | None, *, experts_keep: float, source: str | os.PathLike | None = None,
                      fix: str = "Pass --recover-steps 0.", error: type[Exception] = InvalidRequest) -> int | None:
    """The distillation steps a run takes: expert pruning is one-shot.

    Recovery runs on the torch reference forward, which has no mixture-of-experts architecture. So,
    where experts are pruned (`experts_keep` < 1) or `source` is a mixture-of-experts model, an unset
    count (None) means 0; elsewhere None stays None (the defaults of where recovery runs apply). A
    count given with expert pruning is honoured when it is 0 and refused otherwise (`error`, saying
    `fix`: how the caller's surface asks for none). `source` is read only to decide an unset count.
    """
    if recover_steps is not None:
        check_setting(RECOVER_STEPS, recover_steps)
    if experts_keep < 1.0:
        if recover_steps:
            raise error(f"{ONE_SHOT} {fix}")
        return 0
    if recover_steps is None and source is not None:
        from ..runtime.models.gguf_info import inspect_gguf

        if inspect_gguf(source).expert_count:
            return 0
    return recover_steps
