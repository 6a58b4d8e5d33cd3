"""LoRA training speed and memory at a real shape, random weights (what `a3b tune` costs on a GPU).

    python3 -m comfyui_a3b.bench.bench_gpu_tune --out DIR                  # Qwen3-8B shape, on the GPU
    python3 -m comfyui_a3b.bench.bench_gpu_tune --out DIR --shape tiny     # a check on the CPU

The base is prune/'s torch reference forward built directly at the shape (tune/model.py
`random_base`: bf16 matrices on a GPU, 16.4 GB at Qwen3-8B's shape), with the tuner's LoRA (rank 8,
alpha 16, dropout 0.05, on every matrix of every block) and its training step (AdamW, bf16
autocast, gradient clipping). For each configuration (sequence length, batch, gradient
checkpointing): warm-up steps, then timed steps; measured are training tokens/s and the peak GPU
memory of the step (torch's allocator: `max_memory_allocated`, and what it reserved). A failing
configuration (out of memory) is recorded with its error and the run goes on. Then the adapter is
written as a GGUF LoRA (tune/adapter.py) to check the writer at the shape and record its size.
Random weights measure speed and memory, not quality.

Needs torch, gguf and this package only (no llama.cpp). Writes bench_gpu_tune.json, .md and (with
matplotlib) .png into --out. About 2 minutes at the real shape on an H200.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .common import arguments

SHAPES = ("qwen3-8b", "tiny")
#: (seq_len, batch, gradient checkpointing) measured at each shape
CONFIGS = {"qwen3-8b": [(2048, 1, True), (2048, 1, False), (4096, 1, True), (1024, 4, True)],
           "tiny": [(128, 2, True), (128, 2, False)]}


def hparams(shape: str):
    from ..prune.source import HParams

    if shape == "qwen3-8b":
        return HParams(arch="qwen3", n_layer=36, n_embd=4096, n_ff=12288, n_head=32, n_head_kv=8, head_dim=128,
                       n_vocab=151936, eps=1e-6, rope_base=1e6, rope_type="neox", rope_scale=1.0,
                       n_ctx_train=40960, file_type=None, tied_output=False)
    return HParams(arch="qwen3", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16, n_vocab=512,
                   eps=1e-6, rope_base=1e6, rope_type="neox", rope_scale=1.0, n_ctx_train=4096, file_type=None,
                   tied_output=False)


def say(*a) -> None:
    print(*a, flush=True)


def measure(model, torch, device: str, seq_len: int, batch: int, ckpt: bool, warm: int, steps: int,
            n_vocab: int) -> dict:
    from ..prune.device import autocast, synchronize
    from ..tune.lora import token_losses

    model.checkpoint = ckpt
    model.train()
    params = model.trainable()
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    g = torch.Generator(device="cpu").manual_seed(seq_len * 7 + batch)
    x = torch.randint(0, n_vocab, (batch, seq_len), generator=g).to(device)
    w = torch.ones(batch, seq_len, device=device)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_alloc = torch.cuda.memory_allocated() if device == "cuda" else 0
    times, losses = [], []
    for i in range(warm + steps):
        synchronize(device)
        t0 = time.perf_counter()
        with autocast(device):
            s, c = token_losses(model, x, w)
        loss = s / c
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        synchronize(device)
        if i >= warm:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        say(f"  step {i + 1}/{warm + steps}: {time.perf_counter() - t0:.3f} s, loss {losses[-1]:.3f}")
    r = {"seq_len": seq_len, "batch": batch, "grad_checkpointing": ckpt, "steps": steps,
         "step_s": sorted(times)[len(times) // 2], "tokens_per_s": batch * seq_len / sorted(times)[len(times) // 2],
         "losses": losses}
    if device == "cuda":
        r.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                 reserved_gib=torch.cuda.max_memory_reserved() / 2**30, base_gib=base_alloc / 2**30)
    del opt
    return r


def draw_png(r: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [c for c in r["configs"] if "error" not in c]
    if not ok:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{c['batch']}x{c['seq_len']}\n{'ckpt' if c['grad_checkpointing'] else 'no ckpt'}" for c in ok]
    a1.bar(labels, [c["tokens_per_s"] for c in ok])
    a1.set_ylabel("training tokens/s")
    a2.bar(labels, [c.get("peak_gib", 0.0) for c in ok])
    a2.axhline(24, color="red", linestyle="--", label="24 GB")
    a2.set_ylabel("peak GPU memory (GiB)")
    a2.legend()
    fig.suptitle(f"LoRA rank {r['rank']} training at {r['shape']} shape ({r['device_name']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def configs(r: dict, model, torch, device: str, hp, args) -> None:
    """Each configuration of the shape measured into r["configs"]; one that fails (out of memory) is a result."""
    for seq_len, batch, ckpt in CONFIGS[args.shape]:
        say(f"config: batch {batch} x {seq_len} tokens, gradient checkpointing {'on' if ckpt else 'off'}")
        try:
            c = measure(model, torch, device, seq_len, batch, ckpt, args.warm, args.steps, hp.n_vocab)
            peak = f", peak {c['peak_gib']:.1f} GiB" if "peak_gib" in c else ""
            say(f"  -> {c['tokens_per_s']:.0f} tokens/s{peak}")
        except Exception as e:  # noqa: BLE001 - an out-of-memory configuration is a result; the run goes on
            c = {"seq_len": seq_len, "batch": batch, "grad_checkpointing": ckpt,
                 "error": f"{type(e).__name__}: {e}"[:500]}
            say(f"  -> failed: {c['error']}")
            traceback.print_exc(file=sys.stdout)
            if device == "cuda":
                torch.cuda.empty_cache()
        r["configs"].append(c)


def adapter_file(model, hp, rank: int) -> dict:
    """The adapter written and read back: its size, its tensor pairs, the seconds."""
    try:
        from ..tune import adapter

        with tempfile.TemporaryDirectory() as d:
            t1 = time.perf_counter()
            p = adapter.write(Path(d) / "bench.lora.gguf", hp.arch, 2.0 * rank, model.tensors(), {"a3b.bench": 1})
            _, back = adapter.read(p)
            return {"bytes": p.stat().st_size, "pairs": len(back), "write_s": time.perf_counter() - t1}
    except Exception as e:  # noqa: BLE001 - the writer check is one more result
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def markdown(r: dict) -> str:
    rows = ["| batch x seq | checkpointing | tokens/s | step s | peak GiB | reserved GiB | note |",
            "|---|---|---|---|---|---|---|"]
    for c in r["configs"]:
        if "error" in c:
            rows.append(f"| {c['batch']} x {c['seq_len']} | {c['grad_checkpointing']} | - | - | - | - | "
                        f"{c['error'][:80]} |")
        else:
            rows.append(f"| {c['batch']} x {c['seq_len']} | {c['grad_checkpointing']} | {c['tokens_per_s']:.0f} | "
                        f"{c['step_s']:.3f} | {c.get('peak_gib', float('nan')):.2f} | "
                        f"{c.get('reserved_gib', float('nan')):.2f} | |")
    return (f"# LoRA training at {r['shape']} shape, random weights ({r['device_name']}, torch {r['torch']})\n\n"
            f"rank {r['rank']}, alpha {2 * r['rank']}, all seven matrices of every block; base "
            f"{r['base_params'] / 1e9:.2f} B parameters, LoRA {r['lora_params'] / 1e6:.1f} M\n\n"
            + "\n".join(rows) + "\n")


def main(argv=None) -> int:
    from ..prune.device import DEVICES

    ap = arguments(__doc__)
    ap.add_argument("--out", required=True, help="folder for the results")
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    ap.add_argument("--device", choices=DEVICES, default="auto")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    from ..prune.device import resolve_device
    from ..prune.errors import require_torch
    from ..tune.lora import Adapted
    from ..tune.model import random_base
    from ..tune.options import TARGETS

    torch = require_torch()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    hp = hparams(args.shape)
    r: dict = {"benchmark": "bench_gpu_tune", "shape": args.shape, "device": device, "rank": args.rank,
               "alpha": 2.0 * args.rank, "targets": list(TARGETS), "torch": torch.__version__,
               "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "CPU",
               "when": time.strftime("%Y-%m-%d %H:%M:%S"), "configs": []}
    t0 = time.perf_counter()
    say(f"building a random {args.shape} base on {device} ...")
    base = random_base(hp, device)
    model = Adapted(base, list(TARGETS), args.rank, 2.0 * args.rank, 0.05, seed=0)
    r["build_s"] = time.perf_counter() - t0
    r["base_params"] = sum(p.numel() for p in base.parameters())
    r["lora_params"] = sum(p.numel() for p in model.trainable())
    if device == "cuda":
        r["base_gib"] = torch.cuda.memory_allocated() / 2**30
    say(f"built in {r['build_s']:.1f} s: {r['base_params'] / 1e9:.2f} B base parameters, "
        f"{r['lora_params'] / 1e6:.1f} M LoRA parameters")
    configs(r, model, torch, device, hp, args)
    r["adapter"] = adapter_file(model, hp, args.rank)
    say(f"adapter: {r['adapter']}")
    r["total_s"] = time.perf_counter() - t0
    (out / "bench_gpu_tune.json").write_text(json.dumps(r, indent=2, default=float))
    md = markdown(r)
    (out / "bench_gpu_tune.md").write_text(md)
    png = draw_png(r, out / "bench_gpu_tune.png")
    say(md)
    say(f"wrote {out / 'bench_gpu_tune'}.json, .md" + (", .png" if png else " (no matplotlib: no PNG)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
