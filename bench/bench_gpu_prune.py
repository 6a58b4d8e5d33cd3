"""Streamed pruning at a real shape with calibration on the GPU, and the pruned files' speed.

    python -m comfyui_a3b.bench.bench_gpu_prune --out DIR                    # Qwen3-8B shape, on a GPU
    python -m comfyui_a3b.bench.bench_gpu_prune --out DIR --shape qwen3-30b-a3b   # experts (REAP) 0.75, 0.5
    python -m comfyui_a3b.bench.bench_gpu_prune --out DIR --shape tiny       # a check on the CPU
    sh bench/gpu_prune.sh DIR                                                # the same, with checks first

1. Writes a random-weight Qwen3-8B-shape GGUF (36 layers, 4096 wide, FFN 12288, Q4_0; models.py's
   `write_model`), or with `--shape qwen3-30b-a3b` a qwen3moe one at Qwen3-30B-A3B's shape (48
   layers, 2048 wide, 128 experts of width 768, 8 routed per token, 32 query / 4 KV heads; about
   17 GB). Random weights are fine for memory and speed, not for quality.
2. For each keep ratio (of a mixture-of-experts shape: each `--experts-keeps` ratio, with
   `--experts-keep R --expert-method reap`), `a3b prune --calibration llama --recover-steps 0 --n-gpu-layers -1` in a
   child process: statistics from llama.cpp's graph evaluation callback with every layer on the GPU,
   one layer planned at a time, the output written one tensor at a time. Measured: wall time, peak
   RSS and peak anonymous RSS of the child (sampled; file-backed pages of the memory-mapped source
   are page cache, anonymous memory is what the pruning holds), and the child's peak GPU memory
   (nvidia-smi, per process; else the device's used memory through ggml).
3. The unpruned and the pruned files loaded side by side, fully offloaded (the seconds each load
   takes, the file in the page cache, are recorded too): decode tokens/s (one
   token at a time after a short prompt) and prefill tokens/s (one long prompt), alternately, best
   of `--reps` each, as ratios to the unpruned file in the same run.

Needs no torch: the default method (wanda) scores neurons from llama.cpp's per-neuron sums, so the
GPU machine needs llama-cpp-python (CUDA build), numpy, gguf and tqdm only. `--method obs` (least
squares, Gram matrices) needs torch. Writes bench_gpu_prune.json (of a mixture-of-experts shape:
bench_gpu_prune_moe.json), .md and (with matplotlib) .png into --out; `--plot FILE.json` draws the
PNG later where matplotlib is.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .common import arguments, command, machine, model_option
from .models import SHAPES, random_model

#: run in the child: `a3b prune` with a sampler of its own memory (RSS and anonymous RSS, /proc)
CHILD = r"""
import json, os, sys, threading, time
if os.environ.get("A3B_BENCH_BLOCK_TORCH"):
    sys.modules["torch"] = None  # prove that the path needs no torch
peak = {"rss": 0, "anon": 0}
def sample():
    while True:
        try:
            with open("/proc/self/status") as f:
                st = dict(ln.split(":", 1) for ln in f if ":" in ln)
            peak["rss"] = max(peak["rss"], int(st["VmRSS"].split()[0]) * 1024)
            peak["anon"] = max(peak["anon"], int(st.get("RssAnon", "0 kB").split()[0]) * 1024)
        except (OSError, KeyError, ValueError):
            return
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
import resource
from comfyui_a3b.cli import main
rc = main(sys.argv[1:])
peak["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("MEM " + json.dumps(peak), flush=True)
sys.exit(rc)
"""


def _nvidia_smi() -> str | None:
    return shutil.which("nvidia-smi")


class VramSampler:
    """Peak GPU memory of one process (nvidia-smi), or of the device (ggml) where nvidia-smi is absent."""

    def __init__(self, pid: int):
        self.pid, self.peak, self.how = pid, 0, None
        self._stop = threading.Event()
        self._base = None
        if _nvidia_smi():
            self.how = "nvidia-smi, per process"
        else:
            from comfyui_a3b.runtime.llama.devices import gpus

            found = gpus()
            if found:
                self.how = "device used memory (ggml), minus the start"
                self._base = found[0].total_bytes - found[0].free_bytes
        self._t = threading.Thread(target=self._run, daemon=True)
        if self.how:
            self._t.start()

    def _one(self) -> int:
        if self._base is None:
            query = ["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
            out = subprocess.run([_nvidia_smi(), *query], capture_output=True, text=True, timeout=10).stdout
            return sum(int(b) << 20 for a, b in (ln.split(",") for ln in out.splitlines() if "," in ln)
                       if int(a) == self.pid)
        from comfyui_a3b.runtime.llama.devices import gpus

        g = gpus()[0]
        return g.total_bytes - g.free_bytes - self._base

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self._one())
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self._stop.wait(0.2)

    def stop(self) -> int | None:
        self._stop.set()
        if self.how:
            self._t.join(timeout=15)
            return self.peak
        return None


def run_prune(model: Path, out: Path, args: list[str], cache: Path, block_torch: bool) -> dict:
    cmd = [sys.executable, "-c", CHILD, "prune", str(model), "--out", str(out), "--force", "--quiet", "--json",
           "--cache-dir", str(cache), *args]
    # the files are the ones this run writes: no need to vet them in a child process first (that
    # loads a 4.6 GB model on the CPU once per file)
    env = dict(os.environ, A3B_VET="off", **({"A3B_BENCH_BLOCK_TORCH": "1"} if block_torch else {}))
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    vram = VramSampler(p.pid)
    stdout, stderr = p.communicate()
    wall = time.perf_counter() - t0
    peak_vram = vram.stop()
    if p.returncode != 0:
        raise RuntimeError(f"a3b prune failed ({p.returncode}): {stderr.strip()[-3000:]}")
    lines = stdout.splitlines()
    mem = json.loads(next(ln for ln in lines if ln.startswith("MEM "))[4:])
    summary = json.loads("\n".join(ln for ln in lines if not ln.startswith("MEM ")))
    return {"summary": summary, "wall_s": wall, "peak_rss": max(mem["rss"], mem["maxrss"]), "peak_anon": mem["anon"],
            "peak_vram": peak_vram, "vram_how": vram.how}


def speeds(paths: dict[str, Path], n_gpu_layers: int, decode_tokens: int, prefill_tokens: int, reps: int,
           threads: int) -> dict[str, dict[str, float]]:
    """Decode and prefill tokens/s of every file, loaded together and measured alternately (best of reps)."""
    from .evaluate import LlamaEval

    from .models import prompt

    n_ctx = max(prefill_tokens, 64 + decode_tokens) + 8
    evs, load_s = {}, {}
    for k, p in paths.items():
        t0 = time.perf_counter()
        evs[k] = LlamaEval(p, n_ctx=n_ctx, n_threads=threads, n_gpu_layers=n_gpu_layers)
        load_s[k] = time.perf_counter() - t0
    try:
        short, long = prompt(32), prompt(prefill_tokens - 1, 5)
        for ev in evs.values():  # warm-up
            ev.decode_speed(short, 4)
            ev.prefill_speed(long[:256])
        res = {k: {"decode_tps": 0.0, "prefill_tps": 0.0, "load_s": load_s[k]} for k in evs}
        for _ in range(reps):
            for k, ev in evs.items():
                res[k]["decode_tps"] = max(res[k]["decode_tps"], ev.decode_speed(short, decode_tokens))
                res[k]["prefill_tps"] = max(res[k]["prefill_tps"], ev.prefill_speed(long))
    finally:
        for ev in evs.values():
            ev.close()
    return res


@contextlib.contextmanager
def _vetting_off():
    """A3B_VET=off while this run loads the files it wrote itself (restored afterwards)."""
    before = os.environ.get("A3B_VET")
    os.environ["A3B_VET"] = "off"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("A3B_VET", None)
        else:
            os.environ["A3B_VET"] = before


def table(r: dict) -> str:
    base = r["speed"]["unpruned"]
    moe = "n_expert" in r["shape_dims"]
    width = "experts" if moe else "FFN width"
    lines = [f"| file | {width} | GB | prune wall s | peak RSS GB (x file) | peak anon RSS GB | peak VRAM GB | "
             "load s | decode tok/s (x) | prefill tok/s (x) |", "|" + " --- |" * 10]

    def load(sp: dict) -> str:
        return f"{sp['load_s']:.1f}" if "load_s" in sp else "n/a"

    src_width = r["shape_dims"]["n_expert"] if moe else r["n_ff"]
    lines.append(f"| unpruned | {src_width} | {r['model_bytes'] / 1e9:.2f} | - | - | - | - | {load(base)} | "
                 f"{base['decode_tps']:.1f} (1) | {base['prefill_tps']:.0f} (1) |")
    for name, c in r["prunes"].items():
        s = r["speed"][name]
        vr = f"{c['peak_vram'] / 1e9:.2f}" if c["peak_vram"] is not None else "n/a"
        lines.append(
            f"| {name} | {c['n_expert'] if moe else c['n_ff']} | {c['bytes'] / 1e9:.2f} | {c['wall_s']:.0f} | "
            f"{c['peak_rss'] / 1e9:.2f} ({c['peak_rss'] / r['model_bytes']:.2f}x) | "
            f"{c['peak_anon'] / 1e9:.2f} | {vr} | {load(s)} | "
            f"{s['decode_tps']:.1f} ({s['decode_tps'] / base['decode_tps']:.2f}) | "
            f"{s['prefill_tps']:.0f} ({s['prefill_tps'] / base['prefill_tps']:.2f}) |")
    return "\n".join(lines)


def draw_png(r: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = ["unpruned", *r["prunes"]]
    base = r["speed"]["unpruned"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, key, title in ((axes[0], "decode_tps", "decode"), (axes[1], "prefill_tps", "prefill")):
        vals = [r["speed"][n][key] / base[key] for n in names]
        ax.bar(names, vals, color=["grey"] + ["C0"] * (len(names) - 1))
        for i, v in enumerate(vals):
            ax.annotate(f"{r['speed'][names[i]][key]:.0f} tok/s", (i, v), ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_title(f"{title} speed vs unpruned ({r['device']})", fontsize=9)
        ax.set_ylabel("x unpruned")
    fig.suptitle(f"pruned {r['shape']} ({r['method']}, llama.cpp calibration, n_gpu_layers {r['n_gpu_layers']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def options() -> argparse.ArgumentParser:
    ap = arguments(__doc__)
    ap.add_argument("--out", help="folder for the results (and the model files, unless --work)")
    ap.add_argument("--work", help="folder for the model files (default: a temporary folder, removed at the end)")
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    model_option(ap, help="a random model of --shape written earlier (models.write_model), "
                          "e.g. while llama-cpp-python was building; default: written now")
    ap.add_argument("--keeps", default=None, help="FFN neuron keep ratios (default: 0.8,0.63 for a dense shape, "
                                                 "none for a mixture-of-experts shape)")
    ap.add_argument("--experts-keeps", default="0.75,0.5",
                    help="expert keep ratios of a mixture-of-experts shape (qwen3-30b-a3b, tiny-moe)")
    ap.add_argument("--method", default="wanda", help="wanda (no torch) or flap; obs needs torch")
    ap.add_argument("--expert-method", default="reap", help="expert ranking of a mixture-of-experts shape")
    ap.add_argument("--calib-windows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--n-gpu-layers", type=int, default=None, help="default: -1 with a GPU, else 0")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--block-torch", action="store_true", help="run the pruning with torch made unimportable")
    ap.add_argument("--keep-files", action="store_true", help="leave the model files in the work folder")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier run's JSON")
    return ap


def prune_commands(args, moe: bool, ngl: int) -> list[tuple[str, list[str]]]:
    """(row name, `a3b prune` options) of each pruning run."""
    shared = ["--calibration", "llama", "--recover-steps", "0", "--n-gpu-layers", str(ngl), "--calib-windows",
              str(args.calib_windows), "--seq-len", str(args.seq_len)] + \
        (["--threads", str(args.threads)] if args.threads else [])
    runs = [(f"{args.method}@{float(k):g}", ["--keep", k, "--method", args.method])
            for k in (args.keeps or ("" if moe else "0.8,0.63")).split(",") if k]
    if moe:
        runs += [(f"{args.expert_method}@experts {float(k):g}", ["--experts-keep", k, "--expert-method",
                                                                 args.expert_method])
                 for k in args.experts_keeps.split(",") if k]
    return [(name, how + shared) for name, how in runs]


def prune_all(r: dict, model: Path, work: Path, args, ngl: int) -> dict[str, Path]:
    """Each pruning run in a child, its figures in r["prunes"]; the files by row name, the source's first."""
    paths = {"unpruned": model}
    for i, (name, cli) in enumerate(prune_commands(args, "n_expert" in SHAPES[args.shape], ngl)):
        dst = work / f"pruned-{i}.gguf"
        res = run_prune(model, dst, cli, work / "cache", args.block_torch)
        s = res.pop("summary")
        n_expert = s.get("n_expert")
        r["prunes"][name] = {**res, "n_ff": s["n_ff"], "n_expert": n_expert, "bytes": dst.stat().st_size,
                             "seconds": s.get("seconds"), "args": cli}
        paths[name] = dst
        vr = "n/a" if res["peak_vram"] is None else f"{res['peak_vram'] / 1e9:.2f} GB"
        print(f"{name}: FFN {s['n_ff']}, experts {n_expert}, {res['wall_s']:.0f} s, "
              f"peak RSS {res['peak_rss'] / 1e9:.2f} GB "
              f"(anonymous {res['peak_anon'] / 1e9:.2f} GB), peak VRAM {vr}; stages {s.get('seconds')}", flush=True)
    return paths


def write_all(r: dict, out: Path, base_name: str) -> None:
    """<base_name>.json, .md (the table, printed too) and .png into `out`."""
    md = table(r)
    print(md)
    (out / f"{base_name}.json").write_text(json.dumps(r, indent=2, default=float))
    (out / f"{base_name}.md").write_text(md + "\n")
    png = draw_png(r, out / f"{base_name}.png")
    print(f"wrote {out / base_name}.json, .md" + (", .png" if png else " (no matplotlib: no PNG; "
          "python -m comfyui_a3b.bench.bench_gpu_prune --plot FILE.json draws it elsewhere)")
          + f"; total {r['total_s']:.0f} s")


def main(argv=None) -> int:
    ap = options()
    args = ap.parse_args(argv)
    if args.plot:
        r = json.loads(Path(args.plot).read_text())
        print(draw_png(r, Path(args.plot).with_suffix(".png")))
        return 0
    if not args.out:
        ap.error("--out is required")
    from comfyui_a3b.runtime.llama.devices import gpus

    out = Path(args.out)
    # the model files (about 13 GB at the real shape) stay out of --out, which holds only results
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-gpu-prune-"))
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    found = gpus()
    ngl = args.n_gpu_layers if args.n_gpu_layers is not None else (-1 if found else 0)
    device = found[0].description if found else "CPU"
    t_start = time.perf_counter()
    dims = SHAPES[args.shape]
    moe = "n_expert" in dims
    base_name = "bench_gpu_prune_moe" if moe else "bench_gpu_prune"
    model, write_s = random_model(args.model, work / f"random-{args.shape}-q4_0.gguf", args.shape)
    print(f"{'wrote' if write_s is not None else 'using'} {model.name}: {model.stat().st_size / 1e9:.2f} GB"
          + (f" in {write_s:.0f} s" if write_s is not None else "") + f"; device {device}, n_gpu_layers {ngl}",
          flush=True)
    r = {"benchmark": base_name, "machine": machine(), "device": device, "shape": args.shape,
         "shape_dims": dims, "method": args.expert_method if moe else args.method, "n_gpu_layers": ngl,
         "calib_windows": args.calib_windows, "seq_len": args.seq_len, "model_bytes": model.stat().st_size,
         "n_ff": dims["n_ff"], "write_model_s": write_s, "prunes": {},
         "command": command("bench_gpu_prune", argv)}
    paths = prune_all(r, model, work, args, ngl)
    with _vetting_off():
        r["speed"] = speeds(paths, ngl, args.decode_tokens, args.prefill_tokens, args.reps, args.threads)
    r["total_s"] = time.perf_counter() - t_start
    write_all(r, out, base_name)
    if not args.keep_files:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
