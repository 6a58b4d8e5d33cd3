"""One-shot FFN-neuron pruning calibrated through llama.cpp, streamed tensor by tensor.

For any architecture llama.cpp runs whose FFN layout layout.py knows (llama, qwen2, qwen3, qwen35,
gemma3). The calibration text runs through the GGUF as llama.cpp loads it (quantised, on the CPU or
with `n_gpu_layers` on a GPU), and llama_stats.FFNInputProbe records the statistics of each layer's
FFN down-projection input. Each layer is then planned on its own (which neurons stay; for obs and
a3b the least-squares re-fit of ffn_down), and the plan is cached on disk per layer, so an
interrupted run resumes with the layers it had not finished.

Gram matrices (obs, a3b) are n_ff x n_ff float64 per layer: 19 MB at n_ff 1536, 566 MB for the 30
layers of the 98 MB embedded model, 1.6 GB each at n_ff 14336. So as many as `gram_budget_mb` holds
(by default half the model file) are accumulated in memory during the pass; the inputs of the other
layers go to files in the cache folder during the same pass, and each of their Gram matrices is made
from its file when the layer is planned (the same sums in the same order: the same matrix). Where
that folder's disk lacks the room, the layers are calibrated in groups instead, one pass each (each
pass stops after its last layer, but runs the layers before it again).

Memory: one layer's tensors (dequantised ffn_down, and gate/up for `magnitude`), the Gram matrices
in the budget and the per-layer sums, never the model: the writer (writing/gguf.py) reads, slices and writes
one tensor at a time, gate/up rows are kept as stored bytes, ffn_down is requantised to its own type
by llama.cpp's quantiser with the calibration's importance matrix (mean squared input per column).

`a3b` here is one-shot OBS on llama.cpp's statistics: its sequential error correction needs the
pruned model's own activations, which the torch reference forward gives (torch_path.py).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...runtime.models.memory import tune_allocator
from ..calibration.llama_stats import FFNInputProbe, gram_bytes, gram_groups, observe, require_llama_runs
from ..calibration.stats import LayerStats
from ..calibration.windows import check_tokens, source_windows
from ..config import DATA_FREE, PruneConfig, default_cache_dir, refuse_torch_parts
from ..device import resolve_device
from ..files import load_npz, save_npz_atomic
from ..layout import FFNLayout, check_layout, layer_of
from ..source import SourceModel
from ..writing import gguf
from ..writing.align import down_type, width_align, width_for
from ..writing.metadata import PruneResult, a3b_metadata
from .methods import LayerPlan, obs_chunk, plan_layer

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
    shapes = {n: src.shape(n) for n in src.tensors}
    layout = check_layout(arch, list(src.tensors), shapes, src.hp.n_layer, ffl, src.path.name)
    return src, layout


def _plan_path(cache: Path, key: str, il: int) -> Path:
    return cache / "plans" / key / f"layer{il:03d}.npz"


def _plan_key(src_sha: str, tokens_digest: str, cfg: PruneConfig, k: int, layout: FFNLayout) -> str:
    h = hashlib.sha256(f"v{PLAN_VERSION}:{src_sha}:{tokens_digest}:{cfg.method}:{k}:{int(layout.down_bias_ok)}:"
                       f"{cfg.seed}:{weighting(cfg, layout)}".encode())
    return h.hexdigest()[:24]


def _plan_one(src: SourceModel, layout: FFNLayout, il: int, method: str, st: LayerStats | None, k: int,
              rng: np.random.Generator, device: str) -> dict[str, np.ndarray]:
    """Plan layer `il` and encode its new ffn_down (and bias) in the stored types."""
    p = f"blk.{il}."
    down = src.weight(p + "ffn_down.weight")
    gate = up = None
    if method == "magnitude":
        up = src.weight(p + "ffn_up.weight")
        gate = src.weight(p + "ffn_gate.weight") if layout.gated else None
    bias = src.weight(p + "ffn_down.bias") if src.has(p + "ffn_down.bias") else None
    plan: LayerPlan = plan_layer(method if method != "a3b" else "obs", gate, up, down, bias, st, k, rng,
                                 layout.down_bias_ok, device=device, chunk=obs_chunk(layout.n_ff), consume=True)
    keep = np.asarray(plan.keep, dtype=np.int64)
    new_down = plan.down if plan.down is not None else np.take(down, keep, axis=1)  # C order, unlike down[:, keep]
    imatrix = None
    if st is not None and st.count:
        imatrix = (st.sumsq[keep] / st.count).astype(np.float32)
    out = {"keep": keep, "down": gguf.encode(new_down, down_type(src.qtype(p + "ffn_down.weight"), k), imatrix)}
    if plan.bias is not None:
        out["bias"] = np.asarray(plan.bias, dtype=np.float32)
    return out


def prune_streamed(source, out, cfg: PruneConfig, *, progress: bool = True, cache_dir=None,
                   should_stop=None, src_layout: tuple[SourceModel, FFNLayout] | None = None):
    """Prune `source` into `out` (see the module docstring). Returns a PruneResult."""
    from tqdm import tqdm

    refuse_torch_parts(cfg, "one-shot pruning calibrated through llama.cpp does not run", recovery=False)
    tune_allocator()  # see runtime/models/memory.py: large arrays made and freed all run long go back whole
    timings: dict[str, float] = {}
    t = time.perf_counter()
    src, layout = src_layout or open_source(source)
    # by default the width fills whole blocks of every ffn_down type (each keeps its type); a smaller
    # --align stores the ffn_down tensors that cannot hold it in llama-quantize's fallback type
    align = width_align(src, cfg.align, "ffn_down.weight", layout.n_layer)
    n_ff = layout.n_ff
    k = width_for(cfg.keep, n_ff, align)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = Path(out)
    pruning = k < n_ff
    wins: list[list[int]] = []
    corpus_info: dict[str, Any] = {}
    needs_stats = pruning and cfg.method not in DATA_FREE
    if pruning:
        cfg, wins, corpus_info, _, _ = source_windows(src, cfg)
        check_tokens(cfg, n_ff, f"method {cfg.method}", fitted=cfg.method in GRAM_METHODS)
    timings["load"] = time.perf_counter() - t

    # -- calibration and per-layer plans ------------------------------------------------------------
    t = time.perf_counter()
    device = "cpu"
    if pruning and cfg.method in GRAM_METHODS:
        device = resolve_device(cfg.device)
    tok = np.array(wins, dtype=np.int32) if wins else np.zeros((0, 0), np.int32)
    key = _plan_key(src.sha256, hashlib.sha256(tok.tobytes()).hexdigest(), cfg, k, layout)
    plans: dict[int, dict[str, np.ndarray]] = {}
    passes = 0
    if pruning:
        missing = [i for i in range(layout.n_layer) if not _plan_path(cache, key, i).is_file()]
        rng = np.random.default_rng(cfg.seed)
        groups, spill = [missing] if missing else [], []
        if cfg.method in GRAM_METHODS and missing:
            budget = (cfg.gram_budget_mb << 20) if cfg.gram_budget_mb else os.path.getsize(src.path) // 2
            held = max(1, budget // gram_bytes(n_ff))
            if len(missing) > held and spill_room(cache, len(missing) - held, len(wins) * cfg.seq_len, n_ff):
                spill = missing[held:]
            elif len(missing) > held:
                groups = [[missing[j] for j in g] for g in gram_groups(len(missing), n_ff, budget)]
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".spill-") as spill_dir:
            for group in groups:
                probe = None
                if needs_stats:
                    probe = _collect(src, layout, wins, group, cfg, device, progress, should_stop, len(groups),
                                     passes, Path(spill_dir), spill)
                    passes += 1
                for il in tqdm(group, desc=f"planning ({cfg.method})", unit="layer", disable=not progress):
                    if should_stop is not None and should_stop():
                        raise KeyboardInterrupt
                    # random selection: one generator per layer, so a resumed run picks the same neurons
                    lrng = np.random.default_rng([cfg.seed, il]) if cfg.method == "random" else rng
                    st = probe.take(il) if probe is not None else None  # then its Gram matrix is gone
                    plan = _plan_one(src, layout, il, cfg.method, st, k, lrng, device)
                    path = _plan_path(cache, key, il)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    save_npz_atomic(path, plan)
    timings["calibrate+plan"] = time.perf_counter() - t

    # -- streamed write -------------------------------------------------------------------------------
    t = time.perf_counter()

    def plan(il: int) -> dict[str, np.ndarray]:
        if il not in plans:
            p = load_npz(_plan_path(cache, key, il))
            if p is None:
                raise RuntimeError(f"the cached plan of layer {il} is missing or damaged; run the command again")
            plans.clear()  # one layer's plan in memory at a time
            plans[il] = p
        return plans[il]

    tensors: list[gguf.OutTensor] = []
    new_bias: list[gguf.OutTensor] = []
    fallback = 0
    for name in src.tensors:
        il = layer_of(name)
        part = name.split(".", 2)[2] if il is not None else ""
        if not pruning or il is None or part not in ("ffn_gate.weight", "ffn_up.weight", "ffn_gate.bias",
                                                     "ffn_up.bias", "ffn_down.weight", "ffn_down.bias"):
            tensors.append(gguf.copy_tensor(src, name))
        elif part == "ffn_down.weight":
            qt = down_type(src.qtype(name), k)
            fallback += qt != src.qtype(name)
            tensors.append(gguf.OutTensor(name, qt, (src.shape(name)[0], k), lambda il=il: plan(il)["down"]))
        elif part == "ffn_down.bias":
            tensors.append(_bias_tensor(src, name, il, plan))
        else:
            tensors.append(gguf.OutTensor(name, src.qtype(name), (k, *src.shape(name)[1:]),
                                          lambda il=il, name=name: np.ascontiguousarray(
                                              src.stored(name)[plan(il)["keep"]])))
    if pruning and layout.down_bias_ok:
        for il in range(layout.n_layer):
            name = f"blk.{il}.ffn_down.bias"
            if name not in src.tensors and "bias" in (load_npz(_plan_path(cache, key, il)) or {}):
                new_bias.append(_bias_tensor(src, name, il, plan))
    tensors += new_bias
    selection = {"obs": "obs-oneshot", "a3b": "obs-oneshot"}.get(cfg.method, cfg.method) if pruning else "none"
    meta = a3b_metadata(
        src, cfg, selection=selection, align=align, n_ff=k, n_ff_source=n_ff, calib_engine="llama.cpp",
        corpus=corpus_info, **{
            "calib.n_gpu_layers": int(cfg.n_gpu_layers),
            "calib.weighting": weighting(cfg, layout) if pruning else "none",
            "requant": "ggml_quantize_chunk, source type per tensor, calibration importance matrix",
            "requant.fallback_tensors": int(fallback),
            "bias_compensation": bool(new_bias) or any(
                "bias" in (load_npz(_plan_path(cache, key, i)) or {}) for i in range(layout.n_layer if pruning else 0)),
            "gate.kind": "none"})
    gguf.write_file(src, out, tensors, n_ff=k, a3b=meta, progress=progress, should_stop=should_stop)
    timings["write"] = time.perf_counter() - t
    meta["calib.passes"] = passes
    return PruneResult(out, n_ff, k, meta, timings, [])


def _bias_tensor(src: SourceModel, name: str, il: int, plan) -> gguf.OutTensor:
    n_embd = src.hp.n_embd

    def make():
        p = plan(il)
        if "bias" in p:
            return p["bias"].astype(np.float32)
        return src.weight(name).astype(np.float32)

    return gguf.OutTensor(name, 0, (n_embd,), make)


def weighting(cfg: PruneConfig, layout: FFNLayout) -> str:
    """How the least-squares fit weights calibration tokens: "post-norm" (each by 1 / its FFN output's
    mean square, for a normed FFN output; llama_stats.FFNInputProbe) or "uniform"."""
    return "post-norm" if layout.post_norm and cfg.method in GRAM_METHODS else "uniform"


def _collect(src: SourceModel, layout: FFNLayout, wins, layers: list[int], cfg: PruneConfig, device: str,
             progress: bool, should_stop, n_passes: int, done: int, spill_dir: Path,
             spill: list[int]) -> FFNInputProbe:
    """One pass of llama.cpp over the calibration windows, observing `layers` (`spill`: those whose inputs
    go through files in `spill_dir`); the probe hands out each layer's statistics (`take`)."""
    gram = layers if cfg.method in GRAM_METHODS else []
    probe = FFNInputProbe(src.hp.n_layer, layers=layers, gram_layers=gram, device=device,
                          weighted=weighting(cfg, layout) == "post-norm", spill_dir=spill_dir, spill_layers=spill)
    what = f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
    desc = f"calibrating (llama.cpp, {what}" + (f", pass {done + 1}/{n_passes})" if n_passes > 1 else ")")
    observe(src, [probe], wins, cfg, desc, progress=progress, should_stop=should_stop)
    return probe


def spill_room(cache: Path, n_layers: int, n_tokens: int, n_ff: int) -> bool:
    """Whether the cache folder's disk holds the spilled inputs of `n_layers` layers, with room to spare
    (float32 rows and a float64 weight per token)."""
    need = n_layers * n_tokens * (4 * n_ff + 8)
    cache.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(cache).free > 2 * need + gguf.DISK_MARGIN
