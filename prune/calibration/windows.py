"""The text calibration and recovery read, in the model's own tokens, and the checks that it is enough.

Calibration reads `calib_windows` windows of `seq_len` tokens, code and prose interleaved half and
half, of the built-in corpus (corpus.py) or of the --calib-file / --calib-dir texts. Recovery reads
every window of `recover_seq_len` tokens of the calibration corpus, of the wide corpus, or of those
files, one array per kind of text (code and prose apart, so its batches can mix them in shares).
Each returns, beside the windows, a description of its text for the output's metadata.
"""
from __future__ import annotations

import platform
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ...runtime.llama.weights import Weights
from .. import corpus as corpusmod
from ..textfiles import dir_items
from ..wide import wide_corpus
from ..config import DATA_FREE, PruneConfig
from ..errors import CorpusTooSmall
from ..source import SourceModel

#: calibration windows taken at most from each kind of recovery text (all of them, in practice)
ALL = 1 << 30


def tokenizer(src: SourceModel):
    """llama.cpp's tokenizer of `src` (vocabulary only, no weights): (its Weights to free, a tokenize
    function, the BOS token to prepend or None)."""
    w = Weights(src.path, vocab_only=True)
    bos = w.bos if w.add_bos and w.bos >= 0 else None
    return w, (lambda text: w.tokenize(text, add_bos=False, special=False)), bos


def _files_corpus(cfg: PruneConfig) -> corpusmod.Corpus:
    """The --calib-file texts and the text files under --calib-dir, used instead of the built-in corpus
    for calibration and recovery."""
    items = [(Path(f).name, Path(f).read_text(encoding="utf-8", errors="replace")) for f in cfg.calib_files]
    for d in cfg.calib_dirs:
        items += [(f"{Path(d).name}/{n}", t) for n, t in dir_items(d)]
    return corpusmod.Corpus("files", "calibration", items)


def calibration_windows(tokenize, bos, cfg: PruneConfig) -> tuple[list[list[int]], dict[str, Any]]:
    """The calibration windows and a description of the text they came from (for the metadata)."""
    if cfg.calib_files or cfg.calib_dirs:
        c = _files_corpus(cfg)
        wins = corpusmod.windows(tokenize, c, cfg.seq_len, cfg.calib_windows, bos)
        info = {"calib.corpus": "files", "calib.files": c.names, "calib.digest": c.digest()}
    else:
        cs = corpusmod.corpora("calibration")
        half = (cfg.calib_windows + 1) // 2
        code = corpusmod.windows(tokenize, cs["code"], cfg.seq_len, half, bos)
        prose = corpusmod.windows(tokenize, cs["prose"], cfg.seq_len, cfg.calib_windows - len(code), bos)
        wins = corpusmod.interleave(code, prose)
        held = corpusmod.corpora("heldout")
        info = {"calib.corpus": "python-stdlib-source+pydoc-topics",
                "calib.python": platform.python_version(),
                "calib.code_modules": cs["code"].names, "calib.prose_topics": cs["prose"].names,
                "heldout.code_modules": held["code"].names, "heldout.prose_topics": held["prose"].names,
                "calib.digest": corpusmod.calibration_digest()}
    if len(wins) < cfg.calib_windows:
        raise CorpusTooSmall(f"the calibration text gives {len(wins)} windows of {cfg.seq_len} tokens, "
                             f"{cfg.calib_windows} were requested: give more text, or lower --calib-windows "
                             "or --seq-len.")
    info.update({"calib.windows": len(wins), "calib.seq_len": cfg.seq_len})
    return wins, info


def recovery_windows(tokenize, bos, cfg: PruneConfig) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Distillation text: every window of `recover_seq_len` tokens of the calibration corpus or of the
    wide corpus (`recover_corpus`; code and prose kept apart, so batches can mix them in their shares),
    or of the --calib-file / --calib-dir texts."""
    extra: dict[str, Any] = {}
    if cfg.calib_files or cfg.calib_dirs:
        kinds = {"files": corpusmod.windows(tokenize, _files_corpus(cfg), cfg.recover_seq_len, ALL, bos)}
    elif cfg.recover_corpus == "wide":
        wide = wide_corpus()
        kinds = {k: corpusmod.windows(tokenize, c, cfg.recover_seq_len, ALL, bos) for k, c in wide.recovery.items()}
        extra = wide.describe()
    else:
        kinds = {k: corpusmod.windows(tokenize, c, cfg.recover_seq_len, ALL, bos)
                 for k, c in corpusmod.corpora("calibration").items()}
    arrays = [np.array(w, dtype=np.int32) for w in kinds.values() if w]
    if not arrays:
        raise CorpusTooSmall(f"the calibration text gives no window of {cfg.recover_seq_len} tokens for recovery; "
                             "give more text or lower the recovery sequence length.")
    return arrays, {"recover.windows": int(sum(len(a) for a in arrays)),
                    **{f"recover.windows.{k}": len(w) for k, w in kinds.items()}, **extra}


def source_windows(src: SourceModel, cfg: PruneConfig, *, recovery: bool = False):
    """`cfg` with the window length capped at the model's training context, the calibration windows in
    `src`'s own tokens and their description for the metadata, and with `recovery` the recovery
    windows and theirs (else None and {})."""
    weights, tokenize, bos = tokenizer(src)
    try:
        if cfg.seq_len > src.hp.n_ctx_train:
            cfg = replace(cfg, seq_len=src.hp.n_ctx_train)
        wins, info = calibration_windows(tokenize, bos, cfg)
        rwins, rinfo = recovery_windows(tokenize, bos, cfg) if recovery else (None, {})
    finally:
        weights.free()
    return cfg, wins, info, rwins, rinfo


def check_tokens(cfg: PruneConfig, n: int, what: str, *, fitted: bool) -> None:
    """CorpusTooSmall unless the calibration tokens are enough: a fitted n x n covariance per layer
    (`fitted`: a least-squares fit over n inputs) needs at least 2n of them, activation statistics
    at least 64."""
    n_tokens = cfg.calib_windows * cfg.seq_len
    if fitted and n_tokens < 2 * n:
        raise CorpusTooSmall(f"{what} fits a {n}x{n} covariance per layer and needs at least {2 * n} calibration "
                             f"tokens; {cfg.calib_windows} windows x {cfg.seq_len} tokens = {n_tokens}. "
                             "Raise --calib-windows.")
    if cfg.method not in DATA_FREE and n_tokens < 64:
        raise CorpusTooSmall(f"method {cfg.method} needs activation statistics over at least 64 tokens; "
                             f"got {n_tokens}. Raise --calib-windows.")
