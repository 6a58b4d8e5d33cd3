"""One-shot FFN-neuron pruning calibrated through llama.cpp, streamed tensor by tensor.

For any architecture llama.cpp runs whose FFN layout layout.py knows (llama, qwen2, qwen3, qwen35,
gemma3). The calibration text runs through the GGUF as llama.cpp loads it (quantised, on the CPU or
with `n_gpu_layers` on a GPU), and llama_stats.FFNInputProbe records the statistics of each layer's
FFN down-projection input. Each layer is then planned on its own (which neurons stay; for obs and
a3b the least-squares re-fit of ffn_down), and the plan is cached on disk per layer, so an
interrupted run resumes with the layers it had not finished. Gram matrices (obs, a3b) are collected
for as many layers per pass as `gram_budget_mb` holds.

Memory: one layer's tensors (dequantised ffn_down, and gate/up for `magnitude`), one group of Gram
matrices and the per-layer sums, never the model: the writer (stream.py) reads, slices and writes
one tensor at a time, gate/up rows are kept as stored bytes, ffn_down is requantised to its own type
by llama.cpp's quantiser with the calibration's importance matrix (mean squared input per column).

`a3b` here is one-shot OBS on llama.cpp's statistics: its sequential error correction needs the
pruned model's own activations, which the torch reference forward gives (pipeline.py).
"""
from __future__ import annotations

import hashlib
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.errors import UnsupportedArchitecture
from . import stream
from .calibrate import LayerStats, save_npz_atomic
from .config import PruneConfig, default_cache_dir
from .errors import CorpusTooSmall, InvalidRequest
from .layout import FFNLayout, check_layout, layer_of
from .methods import DATA_FREE, LayerPlan, obs_chunk, width_for
from .source import SourceModel

PLAN_VERSION = 2  # 2: token-weighted Gram matrices for a post-FFN norm (FFNLayout.post_norm)
GRAM_METHODS = ("obs", "a3b")


def open_source(path: str | os.PathLike) -> tuple[SourceModel, FFNLayout]:
    """The source and its FFN layout; typed errors for an architecture llama.cpp does not run or whose
    FFN cannot be pruned (named)."""
    src = SourceModel(path, torch_reference=False)
    arch = src.info.architecture
    require_llama_runs(src)
    f = src.fields.get(f"{arch}.feed_forward_length")
    ffl = None if f is None else f.contents()
    shapes = {n: tuple(int(x) for x in reversed(t.shape)) for n, t in src.tensors.items()}
    layout = check_layout(arch, list(src.tensors), shapes, src.hp.n_layer, ffl, src.path.name)
    return src, layout


def require_llama_runs(src: SourceModel) -> None:
    """UnsupportedArchitecture unless the installed llama.cpp runs `src` (calibration runs it)."""
    from ..runtime.llama import llama_cpp_version, probe_architecture

    ok, why = probe_architecture(src.path)
    if not ok:
        raise UnsupportedArchitecture(
            f"The installed llama.cpp (llama-cpp-python {llama_cpp_version()}) cannot run {src.path.name} "
            f"(architecture {src.info.architecture!r}: {why}); pruning calibrates through llama.cpp, so it needs a "
            "model llama.cpp runs. Upgrade llama-cpp-python or pick another model.")


def source_windows(src: SourceModel, cfg: PruneConfig) -> tuple[list[list[int]], dict[str, Any], PruneConfig]:
    """The calibration windows in `src`'s own tokens, their description for the metadata, and `cfg` with
    the window length capped at the model's training context."""
    from dataclasses import replace

    from .pipeline import _tokenizer, calibration_windows

    weights_ll, tokenize, bos = _tokenizer(src)
    try:
        if cfg.seq_len > src.hp.n_ctx_train:
            cfg = replace(cfg, seq_len=src.hp.n_ctx_train)
        wins, info = calibration_windows(tokenize, bos, cfg)
    finally:
        weights_ll.free()
    return wins, info, cfg


def down_align(src: SourceModel, layout: FFNLayout) -> int:
    """The FFN width must fill whole blocks of every ffn_down's type (256 for K-quants, 32 for Q4_0...)."""
    from . import ggml

    a = 1
    for i in range(layout.n_layer):
        a = math.lcm(a, ggml.block_size(stream.source_type(src, f"blk.{i}.ffn_down.weight")))
    return a


#: llama-quantize's rule for a row length a 256-block type cannot store (by ggml type name): the
#: 32-block type it uses instead. A pruned ffn_down falls back the same way when --align asks for a
#: width that is not a multiple of 256.
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL",
            "IQ3_S": "IQ4_NL", "IQ3_XXS": "IQ4_NL", "IQ2_S": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_XXS": "IQ4_NL",
            "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0"}


def down_type(qtype: int, k: int) -> int:
    """The type a pruned ffn_down of width `k` is stored in: its own, or llama-quantize's fallback."""
    from gguf import GGMLQuantizationType as T

    from . import ggml

    if k % ggml.block_size(qtype) == 0:
        return qtype
    fb = FALLBACK.get(T(qtype).name)
    if fb is not None and k % ggml.block_size(T[fb]) == 0:
        return int(T[fb])
    return int(T.F16)


def _plan_path(cache: Path, key: str, il: int) -> Path:
    return cache / "plans" / key / f"layer{il:03d}.npz"


def _plan_key(src_sha: str, tokens_digest: str, cfg: PruneConfig, k: int, layout: FFNLayout) -> str:
    h = hashlib.sha256(f"v{PLAN_VERSION}:{src_sha}:{tokens_digest}:{cfg.method}:{k}:{int(layout.down_bias_ok)}:"
                       f"{cfg.seed}:{weighting(cfg, layout)}".encode())
    return h.hexdigest()[:24]


def _load_plan(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path) as z:
            return {n: z[n] for n in z.files}
    except (OSError, KeyError, ValueError):
        return None


def _plan_one(src: SourceModel, layout: FFNLayout, il: int, method: str, st: LayerStats | None, k: int,
              rng: np.random.Generator, device: str) -> dict[str, np.ndarray]:
    """Plan layer `il` and encode its new ffn_down (and bias) in the stored types."""
    from .methods import plan_layer

    p = f"blk.{il}."
    down = src.weight(p + "ffn_down.weight")
    gate = up = None
    if method == "magnitude":
        up = src.weight(p + "ffn_up.weight")
        gate = src.weight(p + "ffn_gate.weight") if layout.gated else None
    bias = src.weight(p + "ffn_down.bias") if src.has(p + "ffn_down.bias") else None
    plan: LayerPlan = plan_layer(method if method != "a3b" else "obs", gate, up, down, bias, st, k, rng,
                                 layout.down_bias_ok, device=device, chunk=obs_chunk(layout.n_ff))
    keep = np.asarray(plan.keep, dtype=np.int64)
    new_down = plan.down if plan.down is not None else np.take(down, keep, axis=1)  # C order, unlike down[:, keep]
    imatrix = None
    if st is not None and st.count:
        imatrix = (st.sumsq[keep] / st.count).astype(np.float32)
    out = {"keep": keep,
           "down": stream.encode(new_down, down_type(stream.source_type(src, p + "ffn_down.weight"), k), imatrix)}
    if plan.bias is not None:
        out["bias"] = np.asarray(plan.bias, dtype=np.float32)
    return out


def prune_streamed(source, out, cfg: PruneConfig, *, progress: bool = True, cache_dir=None,
                   should_stop=None, src_layout: tuple[SourceModel, FFNLayout] | None = None):
    """Prune `source` into `out` (see the module docstring). Returns a pipeline.PruneResult."""
    from tqdm import tqdm

    from .pipeline import PruneResult
    from .writer import atomic_path

    if cfg.heads_keep < 1.0:
        raise InvalidRequest("head pruning runs on the torch path (--calibration torch; llama and qwen3).")
    timings: dict[str, float] = {}
    t = time.perf_counter()
    src, layout = src_layout or open_source(source)
    # by default the width fills whole blocks of every ffn_down type (each keeps its type); a smaller
    # --align stores the ffn_down tensors that cannot hold it in llama-quantize's fallback type
    align = cfg.align if cfg.align is not None else down_align(src, layout)
    n_ff = layout.n_ff
    k = width_for(cfg.keep, n_ff, align)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = Path(out)
    pruning = k < n_ff
    wins: list[list[int]] = []
    corpus_info: dict[str, Any] = {}
    needs_stats = pruning and cfg.method not in DATA_FREE
    if pruning:
        wins, corpus_info, cfg = source_windows(src, cfg)
        n_tokens = cfg.calib_windows * cfg.seq_len
        if cfg.method in GRAM_METHODS and n_tokens < 2 * n_ff:
            raise CorpusTooSmall(f"method {cfg.method} fits a {n_ff}x{n_ff} covariance per layer and needs at least "
                                 f"{2 * n_ff} calibration tokens; {cfg.calib_windows} windows x {cfg.seq_len} tokens = "
                                 f"{n_tokens}. Raise --calib-windows.")
        if needs_stats and n_tokens < 64:
            raise CorpusTooSmall(f"method {cfg.method} needs activation statistics over at least 64 tokens; got "
                                 f"{n_tokens}. Raise --calib-windows.")
    timings["load"] = time.perf_counter() - t

    # -- calibration and per-layer plans ------------------------------------------------------------
    t = time.perf_counter()
    device = "cpu"
    if pruning and cfg.method in GRAM_METHODS:
        from .device import resolve_device

        device = resolve_device(cfg.device)
    tok = np.array(wins, dtype=np.int32) if wins else np.zeros((0, 0), np.int32)
    key = _plan_key(src.sha256, hashlib.sha256(tok.tobytes()).hexdigest(), cfg, k, layout)
    plans: dict[int, dict[str, np.ndarray]] = {}
    passes = 0
    if pruning:
        missing = [i for i in range(layout.n_layer) if not _plan_path(cache, key, i).is_file()]
        rng = np.random.default_rng(cfg.seed)
        if cfg.method in GRAM_METHODS:
            from .llama_stats import gram_groups

            groups = [[missing[j] for j in g] for g in gram_groups(len(missing), n_ff, cfg.gram_budget_mb << 20)]
        else:
            groups = [missing] if missing else []
        for group in groups:
            stats: dict[int, LayerStats] = {}
            if needs_stats:
                stats = _collect(src, layout, wins, group, cfg, device, progress, should_stop, len(groups), passes)
                passes += 1
            for il in tqdm(group, desc=f"planning ({cfg.method})", unit="layer", disable=not progress):
                if should_stop is not None and should_stop():
                    raise KeyboardInterrupt
                # random selection: one generator per layer, so a resumed run picks the same neurons
                lrng = np.random.default_rng([cfg.seed, il]) if cfg.method == "random" else rng
                plan = _plan_one(src, layout, il, cfg.method, stats.get(il), k, lrng, device)
                path = _plan_path(cache, key, il)
                path.parent.mkdir(parents=True, exist_ok=True)
                save_npz_atomic(path, plan)
                stats.pop(il, None)  # its Gram matrix is not needed any more
    timings["calibrate+plan"] = time.perf_counter() - t

    # -- streamed write -------------------------------------------------------------------------------
    t = time.perf_counter()

    def plan(il: int) -> dict[str, np.ndarray]:
        if il not in plans:
            p = _load_plan(_plan_path(cache, key, il))
            if p is None:
                raise RuntimeError(f"the cached plan of layer {il} is missing or damaged; run the command again")
            plans.clear()  # one layer's plan in memory at a time
            plans[il] = p
        return plans[il]

    tensors: list[stream.OutTensor] = []
    new_bias: list[stream.OutTensor] = []
    fallback = 0
    for name in src.tensors:
        il = layer_of(name)
        part = name.split(".", 2)[2] if il is not None else ""
        if not pruning or il is None or part not in ("ffn_gate.weight", "ffn_up.weight", "ffn_gate.bias",
                                                     "ffn_up.bias", "ffn_down.weight", "ffn_down.bias"):
            tensors.append(stream.copy_tensor(src, name))
        elif part == "ffn_down.weight":
            shape = stream.source_shape(src, name)
            qt = down_type(stream.source_type(src, name), k)
            fallback += qt != stream.source_type(src, name)
            tensors.append(stream.OutTensor(name, qt, (shape[0], k), lambda il=il: plan(il)["down"]))
        elif part == "ffn_down.bias":
            tensors.append(_bias_tensor(src, name, il, plan))
        else:
            tensors.append(stream.OutTensor(name, stream.source_type(src, name),
                                            (k, *stream.source_shape(src, name)[1:]),
                                            lambda il=il, name=name: np.ascontiguousarray(
                                                stream.stored(src, name)[plan(il)["keep"]])))
    if pruning and layout.down_bias_ok:
        for il in range(layout.n_layer):
            name = f"blk.{il}.ffn_down.bias"
            if name not in src.tensors and "bias" in (_load_plan(_plan_path(cache, key, il)) or {}):
                new_bias.append(_bias_tensor(src, name, il, plan))
    tensors += new_bias
    stream.check_disk(out, stream.output_bytes(tensors))
    selection = {"obs": "obs-oneshot", "a3b": "obs-oneshot"}.get(cfg.method, cfg.method) if pruning else "none"
    meta: dict[str, Any] = {
        "method": cfg.method, "selection": selection, "keep": float(cfg.keep), "keep_actual": k / n_ff,
        "n_ff_source": n_ff, "n_ff": k, "align": int(align), "heads_keep": 1.0,
        "n_head": src.hp.n_head, "n_head_source": src.hp.n_head,
        "source.sha256": src.sha256, "source.name": src.path.name,
        "source.file_type": int(src.hp.file_type) if src.hp.file_type is not None else 0,
        "calib.engine": "llama.cpp", "calib.n_gpu_layers": int(cfg.n_gpu_layers),
        "calib.weighting": weighting(cfg, layout) if pruning else "none",
        "requant": "ggml_quantize_chunk, source type per tensor, calibration importance matrix",
        "requant.fallback_tensors": int(fallback),
        "recover.steps": 0, "recover.kind": "none", "recover.final_kl": 0.0,
        "bias_compensation": bool(new_bias) or any(
            "bias" in (_load_plan(_plan_path(cache, key, i)) or {}) for i in range(layout.n_layer if pruning else 0)),
        "gate.kind": "none", "seed": int(cfg.seed), "config": cfg.key(), **corpus_info,
    }
    with atomic_path(out, force=True) as tmp:
        stream.write(src, tmp, tensors, n_ff=k, a3b=meta, progress=progress, should_stop=should_stop)
    timings["write"] = time.perf_counter() - t
    meta["calib.passes"] = passes
    return PruneResult(out, n_ff, k, meta, timings, [])


def _bias_tensor(src: SourceModel, name: str, il: int, plan) -> stream.OutTensor:
    n_embd = src.hp.n_embd

    def make():
        p = plan(il)
        if "bias" in p:
            return p["bias"].astype(np.float32)
        return src.weight(name).astype(np.float32)

    return stream.OutTensor(name, 0, (n_embd,), make)


def weighting(cfg: PruneConfig, layout: FFNLayout) -> str:
    """How the least-squares fit weights calibration tokens: "post-norm" (each by 1 / its FFN output's
    mean square, for a normed FFN output; llama_stats.FFNInputProbe) or "uniform"."""
    return "post-norm" if layout.post_norm and cfg.method in GRAM_METHODS else "uniform"


def _collect(src: SourceModel, layout: FFNLayout, wins, layers: list[int], cfg: PruneConfig, device: str,
             progress: bool, should_stop, n_passes: int, done: int) -> dict[int, LayerStats]:
    """One pass of llama.cpp over the calibration windows, observing `layers`."""
    from tqdm import tqdm

    from .llama_stats import FFNInputProbe, LlamaCalibrator

    gram = layers if cfg.method in GRAM_METHODS else []
    probe = FFNInputProbe(src.hp.n_layer, layers=layers, gram_layers=gram, device=device,
                          weighted=weighting(cfg, layout) == "post-norm")
    what = f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
    desc = f"calibrating (llama.cpp, {what}" + (f", pass {done + 1}/{n_passes})" if n_passes > 1 else ")")
    bar = tqdm(total=len(wins), desc=desc, unit="seq", disable=not progress)
    try:
        with LlamaCalibrator(src.path, n_ctx=cfg.seq_len, n_gpu_layers=cfg.n_gpu_layers,
                             n_threads=cfg.threads) as cal:
            cal.run([probe], wins, progress=bar.update, should_stop=should_stop)
    finally:
        bar.close()
    return {il: probe.layer_stats(il) for il in layers if il in probe.acc}
