"""Peak memory of `a3b prune` on the embedded model, one-shot and with recovery, against the model's size.

    python -m comfyui_a3b.bench.bench_prune_memory                  # one-shot, and recovery of 3 steps
    python -m comfyui_a3b.bench.bench_prune_memory --steps 0        # one-shot only
    python -m comfyui_a3b.bench.bench_prune_memory --compare DIR    # the same runs of another checkout too
    python -m comfyui_a3b.bench.bench_prune_memory --calib-windows 16   # a shorter calibration (minutes)

Each run is `a3b prune` in a child process with a fresh cache folder (nothing cached: calibration,
plans and recovery all run), on the CPU. Its peak resident size (the kernel's high-water mark of the
child, VmHWM, read as it ends) is compared with the file's size (one-shot) and with the model
dequantised to float32 (recovery: what the torch reference forward holds), both as the whole process
and above the baseline: a child that imports what pruning imports (torch, numpy, gguf, llama.cpp's
libraries, the package) and does nothing else. The baseline is the same for every model; the part
above it is what should follow the model's size.

`--compare DIR` runs the same commands with the package imported from DIR (a folder holding a
`comfyui_a3b` link to another checkout, such as the revision before a change), for a before/after
table. Writes bench/results/bench_prune_memory.{json,png}.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import arguments, plot, print_table, write_results

HWM = ("def hwm():\n"
       "    with open('/proc/self/status') as f:\n"
       "        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith('VmHWM:'))\n")
PEAK = ("import sys\n" + HWM +
        "from comfyui_a3b.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "print('RSS', hwm(), flush=True)\n"
        "sys.exit(rc)\n")
BASELINE = ("import torch, numpy, gguf\n" + HWM +
            "import comfyui_a3b.prune.pipeline, comfyui_a3b.prune.reference\n"
            "from comfyui_a3b.runtime.llama import llama\n"
            "llama()\n"
            "print('RSS', hwm())\n")


def rss_of(code: str, *args: str, pythonpath: str | None = None) -> tuple[int, float, str]:
    """Peak resident bytes of `code` run in a fresh interpreter, its wall time and its standard error."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"child failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    rss = int(next(ln for ln in p.stdout.splitlines() if ln.startswith("RSS")).split()[1])
    return rss, time.perf_counter() - t0, p.stderr


def measure(tree: str, pythonpath: str | None, model: Path, steps: int, sizes: dict[str, int],
            calib: list[str] = ()) -> list[dict]:
    base, _, _ = rss_of(BASELINE, pythonpath=pythonpath)
    runs = [("one-shot", ["--recover-steps", "0", *calib], "file")]
    if steps:
        runs.append((f"recovery, {steps} steps", ["--recover-steps", str(steps), *calib], "float32 model"))
    results = []
    for name, extra, what in runs:
        with tempfile.TemporaryDirectory() as d:
            peak, wall, err = rss_of(PEAK, "prune", str(model), "--out", str(Path(d) / "o.gguf"), "--force",
                                     "--quiet", "--device", "cpu", "--cache-dir", str(Path(d) / "cache"), *extra,
                                     pythonpath=pythonpath)
        size = sizes[what]
        results.append({"tree": tree, "run": name, "peak_bytes": peak, "baseline_bytes": base,
                        "above_baseline_bytes": peak - base, "size_bytes": size, "size_is": what,
                        "peak_ratio": peak / size, "above_baseline_ratio": (peak - base) / size, "wall_s": wall,
                        "notes": [ln for ln in err.splitlines() if ln.startswith("recovery:")]})
    return results


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--steps", type=int, default=3, help="recovery steps of the recovery run, 0 = none (default: 3)")
    ap.add_argument("--compare", metavar="DIR", default=None,
                    help="also run the commands with the package imported from DIR (another checkout's link folder)")
    ap.add_argument("--calib-windows", type=int, default=None, metavar="N",
                    help="calibration windows of every run (default: a3b prune's); fewer make the runs shorter")
    args = ap.parse_args(argv)
    calib = [] if args.calib_windows is None else ["--calib-windows", str(args.calib_windows)]
    from ..prune.source import SourceModel
    from ..runtime import default_model_path

    model = default_model_path()
    src = SourceModel(model)
    sizes = {"file": model.stat().st_size, "float32 model": 4 * sum(int(t.n_elements) for t in src.tensors.values())}
    del src
    results = []
    if args.compare:
        results += measure("compared", args.compare, model, args.steps, sizes, calib)
    results += measure("this checkout", None, model, args.steps, sizes, calib)
    rows = [[r["tree"], r["run"], f"{r['peak_bytes'] / 1e6:.0f} MB", f"{r['above_baseline_bytes'] / 1e6:.0f} MB",
             f"{r['size_bytes'] / 1e6:.0f} MB ({r['size_is']})", f"{r['peak_ratio']:.2f}",
             f"{r['above_baseline_ratio']:.2f}", f"{r['wall_s']:.0f} s"] for r in results]
    print_table(f"a3b prune on {model.name}: peak RSS (baseline: the imports alone, "
                f"{results[-1]['baseline_bytes'] / 1e6:.0f} MB)",
                ["tree", "run", "peak", "above baseline", "against", "peak / size", "above / size", "wall"], rows)
    for r in results:
        for n in r["notes"]:
            print(f"  {r['tree']}, {r['run']}: {n}")
    write_results("bench_prune_memory", {"model": model.name, "file_bytes": sizes["file"],
                                         "calib_windows": args.calib_windows,
                                         "float32_bytes": sizes["float32 model"], "compared": args.compare,
                                         "runs": results})

    def draw(ax):
        names = [f"{r['run']}\n({r['tree']})" for r in results]
        ax.bar(names, [r["above_baseline_ratio"] for r in results], label="above the baseline")
        ax.bar(names, [r["baseline_bytes"] / r["size_bytes"] for r in results],
               bottom=[r["above_baseline_ratio"] for r in results], alpha=0.4, label="baseline (imports)")
        ax.set_ylabel("peak RSS / model size\n(file one-shot, float32 model for recovery)")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend()
    plot("bench_prune_memory", draw, size=(8, 4.5))
    print(json.dumps({f"{r['tree']}: {r['run']}": round(r["peak_ratio"], 2) for r in results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
