"""Pruning on the torch reference forward (llama, qwen2, qwen3): what one-shot llama.cpp calibration
cannot do, namely the sequential a3b method, head pruning and recovery by distillation.

calibrate (reference forward) -> select and compensate (methods.py, sequential.py, heads.py) ->
recover (distill.py, through llama.cpp's rounding: qat.py) -> dynamic gate thresholds (gate.py) ->
write (writing/gguf.py). The calibration statistics and the a3b plans are cached on disk, so a
second run (or one after an interrupt) resumes after them; distillation checkpoints likewise.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ...runtime.models.memory import tune_allocator
from ..calibration import reference_stats
from ..calibration.windows import check_tokens, source_windows
from ..config import PruneConfig, default_cache_dir
from ..device import matmul_speed, resolve_device
from ..errors import require_torch
from ..files import load_npz, save_npz_atomic
from ..reference import RefModel, StreamedLayers
from ..source import SourceModel
from ..writing import gguf
from ..writing.align import width_align, width_for
from ..writing.metadata import PruneResult, a3b_metadata
from . import distill, gate, heads, methods, qat, sequential


def prune_torch(source, out: Path, cfg: PruneConfig, *, progress: bool = True, cache_dir=None,
                should_stop=None, notify=None) -> PruneResult:
    """Prune `source` into `out` on the torch reference forward (see the module docstring)."""
    src = SourceModel(source)
    tune_allocator()  # see runtime/models/memory.py: large arrays made and freed all run long go back whole
    hp = src.hp
    align = width_align(src, cfg.align, "ffn_down.weight", hp.n_layer)
    k = width_for(cfg.keep, hp.n_ff, align)
    if k < hp.n_ff:  # keep 1.0 selects nothing and needs no statistics
        check_tokens(cfg, hp.n_ff, f"method {cfg.method} (FFN activations)", fitted=cfg.method in ("a3b", "obs"))
    r = heads.heads_per_group(hp.arch, hp.n_head, hp.n_head_kv, cfg.heads_keep)
    group = hp.n_head // hp.n_head_kv  # query heads per KV head
    pruning = k < hp.n_ff or r < group
    if r < group:
        check_tokens(cfg, hp.n_head * hp.head_dim, "head pruning (attention outputs)", fitted=True)
    torch = require_torch()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    timings: dict[str, float] = {}
    t = time.perf_counter()
    steps = cfg.recover_steps if pruning else 0  # nothing to recover at keep 1.0
    device = resolve_device(cfg.device)
    if steps and device == "cpu":
        tokens = cfg.recover_batch * cfg.recover_seq_len
        flops = distill.step_flops(_block_params(hp, k, hp.n_head_kv * r), hp.n_vocab, hp.n_embd, tokens,
                                   _block_params(hp, hp.n_ff, hp.n_head))
        distill.notifier(progress, notify)(
            f"recovery: {steps} distillation steps of {tokens} tokens after pruning, estimated at about "
            f"{distill.duration(distill.estimate(steps, flops, matmul_speed()))} on this machine's CPU (measured "
            f"once its first steps ran); {distill.SHORTER}.")
    cfg, wins, corpus_info, rwins, recover_info = source_windows(src, cfg, recovery=bool(steps))
    all_w = {name: src.weight(name) for name in src.tensors}
    teacher = RefModel(hp, all_w).to(device)
    timings["load"] = time.perf_counter() - t

    t = time.perf_counter()
    tokens = np.array(wins, dtype=np.int32)
    stats_key = reference_stats.stats_key(src.sha256, tokens)
    # a3b fits each layer on the pruned model's own activations (sequential.py) and reads none of the
    # unpruned model's statistics: their pass (and their n_ff x n_ff Gram matrices) is for the others
    stats = reference_stats.collect(teacher, wins, src.sha256, cache_dir=cache, progress=progress) \
        if k < hp.n_ff and cfg.method != "a3b" else None
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
    if k < hp.n_ff and cfg.method == "a3b":
        seq_plans = _cached_plans(cache, stats_key, k, bias_ok, lambda: sequential.sequential_plans(
            teacher, tokens, k, bias_ok, progress=progress))
    for i in tqdm(range(hp.n_layer if k < hp.n_ff else 0), desc=f"pruning ({cfg.method})", unit="layer",
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
            changed[p + part + ".weight"] = gguf.RawTensor.rows(src.raw(p + part + ".weight"), plan.keep)
        changed[p + "ffn_down.weight"] = student_w[p + "ffn_down.weight"]
        if plan.bias is not None:
            student_w[p + "ffn_down.bias"] = changed[p + "ffn_down.bias"] = plan.bias
    stats = seq_plans = plan = None  # the statistics and plans are in `changed` now
    if r < group:
        grams = heads.collect_grams(teacher, tokens, heads.gram_cache_path(cache, stats_key), progress=progress)
        n_head = heads.prune_heads(src, all_w, grams, r, student_w, changed)
        grams = None
    timings["select"] = time.perf_counter() - t

    losses: list[float] = []
    # The teacher's tensors are views of `all_w`: the student gets its own copies of those it trains
    # (the pruned ones are new arrays already); what it does not train, the token embedding above all
    # (the tied output head), it shares with the teacher.
    trains = _trained(cfg.recover_train) if steps else lambda name: False
    student = RefModel(replace(hp, n_head=n_head), {
        n: np.array(v, copy=True) if trains(n) and n in all_w and np.shares_memory(v, all_w[n]) else v
        for n, v in student_w.items()}).to(device)
    student_w = None
    if steps and device == "cpu":
        # the teacher's blocks come from the file one at a time (StreamedLayers), and nothing but the
        # student (and what it shares) keeps the dequantised model: on the CPU this is the process's memory
        teacher = RefModel(hp, {n: v for n, v in all_w.items() if not n.startswith("blk.")},
                           layers=StreamedLayers(src))
        src.release_all()   # the file's pages read by the passes before (93 MB of the embedded model's 98)
    all_w = None
    if steps:
        t = time.perf_counter()
        types = {n: src.tensors[n].tensor_type.name for n in src.tensors} if cfg.qat else None
        ckpt = cache / f"distill-{src.sha256[:16]}-{cfg.key()}.pt"
        shares = [cfg.recover_code_share, 1.0 - cfg.recover_code_share] if len(rwins) == 2 else None
        rep = distill.distill(student, teacher, rwins, steps, lr=cfg.lr, batch=cfg.recover_batch, seed=cfg.seed,
                              train=cfg.recover_train, quant_types=types, shares=shares, checkpoint=ckpt,
                              progress=progress, should_stop=should_stop, notify=notify)
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

    recovery = {
        "recover.steps": len(losses),
        "recover.kind": f"logit-kd-{cfg.recover_train}{'-qat' if cfg.qat else ''}" if losses else "none",
        "recover.seq_len": cfg.recover_seq_len, "recover.batch": cfg.recover_batch,
        "recover.code_share": float(cfg.recover_code_share), "recover.lr": float(cfg.lr),
        "recover.final_kl": float(np.mean(losses[-10:])) if losses else 0.0}
    meta = a3b_metadata(
        src, cfg, selection={"a3b": "sequential-obs"}.get(cfg.method, cfg.method) if pruning else "none",
        align=align, n_ff=k, n_ff_source=hp.n_ff, n_head=n_head, calib_engine="torch", corpus=corpus_info,
        **recovery, **{
            "bias_compensation": bool(any(n.endswith("ffn_down.bias") for n in changed)),
            "gate.kind": "cats-silu-threshold", "gate.sparsity": float(cfg.gate_sparsity),
            "gate.thresholds": thresholds}, **recover_info)
    t = time.perf_counter()
    gguf.write_file(src, out, gguf.tensors_from_changes(src, changed), n_ff=k, n_head=n_head, a3b=meta,
                    should_stop=should_stop)
    timings["write"] = time.perf_counter() - t
    if steps:
        ckpt.unlink(missing_ok=True)  # the output holds what it held
    return PruneResult(out, hp.n_ff, k, meta, timings, losses)


def _block_params(hp, n_ff: int, n_head: int) -> int:
    """Weights of the blocks' matrices with FFN width `n_ff` and `n_head` query heads."""
    q = n_head * hp.head_dim
    kv = hp.n_head_kv * hp.head_dim
    return hp.n_layer * (2 * hp.n_embd * q + 2 * hp.n_embd * kv + 3 * hp.n_embd * n_ff)


def _trained(which: str):
    """Whether recovery (`recover_train`) trains the tensor of that GGUF name (as qat.trainable picks)."""
    ffn = tuple(f".{qat.TENSORS[a]}" for a in qat.FFN)
    if which == "ffn":
        return lambda name: name.startswith("blk.") and name.endswith(ffn)
    return lambda name: name.startswith("blk.") or name == "output_norm.weight"


def _cached_plans(cache: Path, stats_key: str, k: int, bias_ok: bool, make) -> list:
    """The a3b plans for one (calibration, width) pair are cached: recovery settings do not change them."""
    path = cache / f"a3b-plan-{stats_key}-k{k}-b{int(bias_ok)}.npz"
    z = load_npz(path) if path.is_file() else None
    if z is not None:
        try:
            return [methods.LayerPlan(z[f"keep{i}"], z[f"down{i}"], z.get(f"bias{i}")) for i in range(int(z["n"]))]
        except KeyError:
            pass  # damaged: planned again
    plans = make()
    arrays: dict[str, np.ndarray] = {"n": np.array(len(plans))}
    for i, pl in enumerate(plans):
        arrays[f"keep{i}"], arrays[f"down{i}"] = pl.keep, pl.down
        if pl.bias is not None:
            arrays[f"bias{i}"] = pl.bias
    path.parent.mkdir(parents=True, exist_ok=True)
    save_npz_atomic(path, arrays)
    return plans
