"""`prune()`: calibrate, select, compensate, recover, gate, write, quantise.

Safe to interrupt: the output appears under its final name only once complete (writer.atomic_path),
and the calibration pass, the expensive part, is cached on disk so a second run resumes after it.
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import corpus as corpusmod
from .calibrate import save_npz_atomic
from .config import PruneConfig, default_cache_dir
from .errors import CorpusTooSmall
from .methods import DATA_FREE, width_for
from .source import SourceModel
from .writer import RawTensor, atomic_path


@dataclass
class PruneResult:
    path: Path
    n_ff_source: int
    n_ff: int
    metadata: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)
    distill_losses: list[float] = field(default_factory=list)


def _tokenizer(src: SourceModel):
    from ..runtime.llama import Weights

    w = Weights(src.path, vocab_only=True)
    bos = w.bos if w.add_bos and w.bos >= 0 else None
    return w, (lambda text: w.tokenize(text, add_bos=False, special=False)), bos


def _files_corpus(cfg: PruneConfig) -> corpusmod.Corpus:
    """The --calib-file texts and the text files under --calib-dir, used instead of the built-in corpus
    for calibration and recovery."""
    items = [(Path(f).name, Path(f).read_text(encoding="utf-8", errors="replace")) for f in cfg.calib_files]
    for d in cfg.calib_dirs:
        items += [(f"{Path(d).name}/{n}", t) for n, t in corpusmod.dir_items(d)]
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
        kinds = {"files": corpusmod.windows(tokenize, _files_corpus(cfg), cfg.recover_seq_len, 1 << 30, bos)}
    elif cfg.recover_corpus == "wide":
        wide = corpusmod.wide_corpus()
        kinds = {k: corpusmod.windows(tokenize, c, cfg.recover_seq_len, 1 << 30, bos) for k, c in wide.recovery.items()}
        extra = wide.describe()
    else:
        kinds = {k: corpusmod.windows(tokenize, c, cfg.recover_seq_len, 1 << 30, bos)
                 for k, c in corpusmod.corpora("calibration").items()}
    arrays = [np.array(w, dtype=np.int32) for w in kinds.values() if w]
    if not arrays:
        raise CorpusTooSmall(f"the calibration text gives no window of {cfg.recover_seq_len} tokens for recovery; "
                             "give more text or lower the recovery sequence length.")
    return arrays, {"recover.windows": int(sum(len(a) for a in arrays)),
                    **{f"recover.windows.{k}": len(w) for k, w in kinds.items()}, **extra}


def _check_covariance(cfg: PruneConfig, n: int, what: str) -> None:
    """A fitted n x n covariance per layer needs at least 2n calibration tokens."""
    n_tokens = cfg.calib_windows * cfg.seq_len
    if n_tokens < 2 * n:
        raise CorpusTooSmall(f"{what} fits a {n}x{n} covariance per layer and needs at least {2 * n} calibration "
                             f"tokens; {cfg.calib_windows} windows x {cfg.seq_len} tokens = {n_tokens}. "
                             "Raise --calib-windows.")


def _check_statistics(cfg: PruneConfig, n_ff: int) -> None:
    if cfg.method in ("a3b", "obs"):
        _check_covariance(cfg, n_ff, f"method {cfg.method} (FFN activations)")
    n_tokens = cfg.calib_windows * cfg.seq_len
    if cfg.method not in DATA_FREE and n_tokens < 64:
        raise CorpusTooSmall(f"method {cfg.method} needs activation statistics over at least 64 tokens; "
                             f"got {n_tokens}. Raise --calib-windows.")


def choose_calibration(cfg: PruneConfig, arch: str) -> str:
    """'torch' or 'llama': where a run's statistics come from (see PruneConfig.calibration)."""
    from .errors import InvalidRequest, UnsupportedArchitecture
    from .layout import TORCH_ARCHITECTURES

    needs_torch = (cfg.keep < 1.0 and cfg.recover_steps > 0) or cfg.heads_keep < 1.0
    torch_ok = arch in TORCH_ARCHITECTURES
    what = ("recovery (--recover-steps)" if cfg.keep < 1.0 and cfg.recover_steps > 0 else "head pruning")
    if cfg.calibration == "torch":
        if not torch_ok:
            raise UnsupportedArchitecture(
                f"--calibration torch needs the torch reference forward, which knows {', '.join(TORCH_ARCHITECTURES)}; "
                f"this model is {arch!r}. Use --calibration llama (or auto).")
        return "torch"
    if cfg.calibration == "llama":
        if needs_torch:
            raise InvalidRequest(f"{what} runs on the torch reference forward; with --calibration llama pass "
                                 "--recover-steps 0 and --heads-keep 1, or use --calibration torch (or auto).")
        return "llama"
    if needs_torch:
        if not torch_ok:
            raise UnsupportedArchitecture(
                f"{what} needs the torch reference forward, which knows {', '.join(TORCH_ARCHITECTURES)}; this model "
                f"is {arch!r}. Pass --recover-steps 0 (and --heads-keep 1) for one-shot pruning calibrated through "
                "llama.cpp.")
        return "torch"
    # One-shot: llama.cpp's statistics of the file as served gave lower held-out perplexity than the
    # torch path's (its one-shot obs and its sequential a3b alike) at keep 0.9, 0.8 and 0.63 on the
    # embedded model (bench_prune_llama), in bounded memory: the torch path is for what needs it.
    return "llama"


def prune(source: str | os.PathLike, out: str | os.PathLike, cfg: PruneConfig | None = None, *,
          force: bool = False, progress: bool = True, cache_dir: str | os.PathLike | None = None,
          should_stop=None) -> PruneResult:
    cfg = cfg or PruneConfig()
    cfg.validate()
    out = Path(out)
    if out.exists() and not force:
        from .errors import OutputExists

        raise OutputExists(f"{out} already exists; choose another --out or pass --force to replace it.")
    from ..runtime.gguf_info import inspect_gguf

    info = inspect_gguf(source)
    if cfg.experts_keep < 1.0 or info.expert_count:
        from .experts import prune_moe  # mixture-of-experts models, and the error for a dense one

        return prune_moe(source, out, cfg, progress=progress, cache_dir=cache_dir, should_stop=should_stop)
    if choose_calibration(cfg, info.architecture) == "llama":
        from .streamed import prune_streamed

        return prune_streamed(source, out, cfg, progress=progress, cache_dir=cache_dir, should_stop=should_stop)
    src = SourceModel(source)
    hp = src.hp
    align = cfg.align if cfg.align is not None else _default_align(src)
    k = width_for(cfg.keep, hp.n_ff, align)
    if k < hp.n_ff:  # keep 1.0 selects nothing and needs no statistics
        _check_statistics(cfg, hp.n_ff)
    from . import heads as headsmod

    r = headsmod.heads_per_group(hp.arch, hp.n_head, hp.n_head_kv, cfg.heads_keep)
    group = hp.n_head // hp.n_head_kv  # query heads per KV head
    pruning = k < hp.n_ff or r < group
    if r < group:
        _check_covariance(cfg, hp.n_head * hp.head_dim, "head pruning (attention outputs)")
    from .errors import require_torch

    torch = require_torch()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    from . import calibrate, distill, gate, methods, qat, sequential
    from .reference import RefModel

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    timings: dict[str, float] = {}
    t = time.perf_counter()
    steps = cfg.recover_steps if pruning else 0  # nothing to recover at keep 1.0
    recover_info: dict[str, Any] = {}
    weights_ll, tokenize, bos = _tokenizer(src)
    try:
        seq_len = min(cfg.seq_len, hp.n_ctx_train)
        if seq_len != cfg.seq_len:
            cfg = PruneConfig(**{**asdict(cfg), "seq_len": seq_len})
        wins, corpus_info = calibration_windows(tokenize, bos, cfg)
        if steps:
            rwins, recover_info = recovery_windows(tokenize, bos, cfg)
    finally:
        weights_ll.free()
    from .device import resolve_device

    device = resolve_device(cfg.device)
    all_w = {name: src.weight(name) for name in src.tensors}
    teacher = RefModel(hp, all_w).to(device)
    timings["load"] = time.perf_counter() - t

    t = time.perf_counter()
    stats = calibrate.collect(teacher, wins, src.sha256, cache_dir=cache, progress=progress) if k < hp.n_ff else None
    timings["calibrate"] = time.perf_counter() - t

    # -- selection and compensation -------------------------------------------------------------
    t = time.perf_counter()
    rng = np.random.default_rng(cfg.seed)
    bias_ok = hp.arch == "llama"
    changed: dict[str, Any] = {}
    student_w = dict(all_w)
    n_head = hp.n_head
    from tqdm import tqdm

    seq_plans = None
    if stats is not None and cfg.method == "a3b":
        seq_plans = _cached_plans(cache, stats.key, k, bias_ok, lambda: sequential.sequential_plans(
            teacher, stats.tokens, k, bias_ok, progress=progress))
    for i in tqdm(range(hp.n_layer if stats is not None else 0), desc=f"pruning ({cfg.method})", unit="layer",
                  disable=not progress or seq_plans is not None):
        p = f"blk.{i}."
        gate_w, up_w, down_w = all_w[p + "ffn_gate.weight"], all_w[p + "ffn_up.weight"], all_w[p + "ffn_down.weight"]
        bias = all_w.get(p + "ffn_down.bias")
        plan = seq_plans[i] if seq_plans is not None else methods.plan_layer(
            cfg.method, gate_w, up_w, down_w, bias, stats.layers[i], k, rng, bias_ok)
        if len(plan.keep) == hp.n_ff and plan.down is None and plan.bias is None:
            continue
        student_w[p + "ffn_gate.weight"] = gate_w[plan.keep]
        student_w[p + "ffn_up.weight"] = up_w[plan.keep]
        student_w[p + "ffn_down.weight"] = plan.down if plan.down is not None else down_w[:, plan.keep]
        for part in ("ffn_gate", "ffn_up"):  # rows are quantised independently: slice the stored bytes
            changed[p + part + ".weight"] = RawTensor.rows(src.raw(p + part + ".weight"), plan.keep)
        changed[p + "ffn_down.weight"] = student_w[p + "ffn_down.weight"]
        if plan.bias is not None:
            student_w[p + "ffn_down.bias"] = changed[p + "ffn_down.bias"] = plan.bias
    if r < group:
        tokens = np.array(wins, dtype=np.int32)
        grams = headsmod.collect_grams(
            teacher, tokens, headsmod.gram_cache_path(cache, calibrate.stats_key(src.sha256, tokens)),
            progress=progress)
        n_head = headsmod.prune_heads(src, all_w, grams, r, student_w, changed)
    timings["select"] = time.perf_counter() - t

    losses: list[float] = []
    # The teacher's tensors are views of `all_w`: a student that trains them needs its own copies.
    student = RefModel(replace(hp, n_head=n_head),
                       {n: np.array(v, copy=True) for n, v in student_w.items()} if steps else student_w).to(device)
    if steps:
        t = time.perf_counter()
        types = {n: src.tensors[n].tensor_type.name for n in src.tensors} if cfg.qat else None
        ckpt = cache / f"distill-{src.sha256[:16]}-{cfg.key()}.pt"
        shares = [cfg.recover_code_share, 1.0 - cfg.recover_code_share] if len(rwins) == 2 else None
        rep = distill.distill(student, teacher, rwins, steps, lr=cfg.lr, batch=cfg.recover_batch, seed=cfg.seed,
                              train=cfg.recover_train, quant_types=types, shares=shares, checkpoint=ckpt,
                              progress=progress, should_stop=should_stop)
        losses = rep.losses
        changed.update(qat.export(student, rep.trained))
        recover_info.update({"recover.tokens": rep.tokens, "recover.emulated_tensors": len(rep.emulated),
                             "recover.trained_tensors": len(rep.trained)})
        timings["recover"] = time.perf_counter() - t
    teacher = None  # free it before the gate and the writer

    t = time.perf_counter()
    gate_windows = np.array(wins[: max(1, min(cfg.gate_windows, len(wins)))])
    thresholds = gate.calibrate_thresholds(student, gate_windows, cfg.gate_sparsity, seed=cfg.seed)
    timings["gate"] = time.perf_counter() - t

    meta: dict[str, Any] = {
        "method": cfg.method, "keep": float(cfg.keep), "keep_actual": k / hp.n_ff,
        "n_ff_source": hp.n_ff, "n_ff": k, "align": int(align),
        "heads_keep": float(cfg.heads_keep), "n_head": n_head, "n_head_source": hp.n_head,
        "source.sha256": src.sha256, "source.name": src.path.name,
        "source.file_type": int(hp.file_type) if hp.file_type is not None else 0,
        "recover.steps": len(losses),
        "recover.kind": f"logit-kd-{cfg.recover_train}{'-qat' if cfg.qat else ''}" if losses else "none",
        "recover.seq_len": cfg.recover_seq_len, "recover.batch": cfg.recover_batch,
        "recover.code_share": float(cfg.recover_code_share), "recover.lr": float(cfg.lr),
        "recover.final_kl": float(np.mean(losses[-10:])) if losses else 0.0,
        "bias_compensation": bool(any(n.endswith("ffn_down.bias") for n in changed)),
        "gate.kind": "cats-silu-threshold", "gate.sparsity": float(cfg.gate_sparsity),
        "gate.thresholds": thresholds, "seed": int(cfg.seed), "config": cfg.key(), "calib.engine": "torch",
        "selection": {"a3b": "sequential-obs"}.get(cfg.method, cfg.method) if pruning else "none",
        **corpus_info, **recover_info,
    }
    t = time.perf_counter()
    from . import stream

    tensors = stream.tensors_from_changes(src, changed)
    stream.check_disk(out, stream.output_bytes(tensors))
    with atomic_path(out, force=True) as tmp_out:
        stream.write(src, tmp_out, tensors, n_ff=k, n_head=n_head, a3b=meta, should_stop=should_stop)
    timings["write"] = time.perf_counter() - t
    if steps:
        ckpt.unlink(missing_ok=True)  # the output holds what it held
    return PruneResult(out, hp.n_ff, k, meta, timings, losses)


def _cached_plans(cache: Path, stats_key: str, k: int, bias_ok: bool, make) -> list:
    """The a3b plans for one (calibration, width) pair are cached: recovery settings do not change them."""
    from .methods import LayerPlan

    path = cache / f"a3b-plan-{stats_key}-k{k}-b{int(bias_ok)}.npz"
    if path.is_file():
        try:
            z = np.load(path)
            n = int(z["n"])
            return [LayerPlan(z[f"keep{i}"], z[f"down{i}"], z[f"bias{i}"] if f"bias{i}" in z else None)
                    for i in range(n)]
        except (OSError, KeyError, ValueError):
            pass
    plans = make()
    arrays: dict[str, np.ndarray] = {"n": np.array(len(plans))}
    for i, pl in enumerate(plans):
        arrays[f"keep{i}"], arrays[f"down{i}"] = pl.keep, pl.down
        if pl.bias is not None:
            arrays[f"bias{i}"] = pl.bias
    path.parent.mkdir(parents=True, exist_ok=True)
    save_npz_atomic(path, arrays)
    return plans


def _default_align(src: SourceModel) -> int:
    """Quantised sources keep widths that fill whole 32-value blocks (all of llama.cpp's block sizes
    for FFN rows divide 32 or fall back); float sources need no alignment."""
    t = src.tensors["blk.0.ffn_down.weight"].tensor_type.name
    return 1 if t in ("F32", "F16", "BF16") else 32
