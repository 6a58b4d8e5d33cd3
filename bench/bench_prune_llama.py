"""One-shot pruning calibrated through llama.cpp, on SmolLM2-135M and Gemma 3 270M (CPU).

    python -m comfyui_a3b.bench.bench_prune_llama                       # both models, keep 0.9/0.8/0.63
    python -m comfyui_a3b.bench.bench_prune_llama --models gemma --keeps 0.8

For each model and configuration, `a3b prune` runs in a child process (its peak RSS is read there,
as a ratio to the model file's size), then llama.cpp measures held-out perplexity as a ratio to the
unpruned file (four held-out sets: standard-library code, whole held-out packages, language-reference
prose topics, and manual pages, prose from a source neither calibration nor recovery reads) and
decode tokens/s as a ratio to the unpruned file loaded beside it. Configurations:

- `llama:a3b@K`: statistics from llama.cpp's graph evaluation of the quantised file, one-shot OBS
  selection and least-squares re-fit, streamed writing (the path for every architecture);
- `torch:obs@K` (SmolLM2): the same method on the torch reference forward's statistics;
- `torch:a3b@K` (SmolLM2): the sequential, error-correcting a3b of the torch path;
- `llama:a3b@K/a32` (Gemma): the width rounded to 32 instead of the K-quant block of 256, the
  ffn_down tensors in llama-quantize's fallback types (Q4_K -> Q5_0, Q6_K -> Q8_0).

Writes bench/results/bench_prune_llama.{json,png}.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import RESULTS, arguments, machine, plot, print_table, write_results
from .evaluate import LlamaEval

HELDOUT_SETS = ("code", "code-packages", "prose", "prose-man")


def heldout(ev, n: int, seq_len: int) -> dict[str, list[list[int]]]:
    from ..prune import corpus, wide

    held = wide.wide_corpus().heldout
    return {k: corpus.windows(ev.tokenize, held[k], seq_len, n, ev.bos) for k in HELDOUT_SETS}


def run_prune(model: Path, out: Path, args: list[str], cache: Path) -> dict:
    """`a3b prune` in a child process; its result and peak RSS."""
    code = ("import json, resource, sys\n"
            "from comfyui_a3b.cli import main\n"
            "rc = main(sys.argv[1:])\n"
            "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)\n"
            "sys.exit(rc)\n")
    cmd = [sys.executable, "-c", code, "prune", str(model), "--out", str(out), "--force", "--quiet", "--json",
           "--cache-dir", str(cache), *args]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"a3b prune failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    lines = p.stdout.splitlines()
    rss = int(next(ln for ln in lines if ln.startswith("RSS")).split()[1])
    summary = json.loads("\n".join(ln for ln in lines if not ln.startswith("RSS")))
    return {"summary": summary, "peak_rss": rss, "wall_s": wall}


def baseline_rss() -> int:
    """Peak RSS of a Python process that imports torch and the package (what every run starts from)."""
    code = ("import resource, torch, numpy, gguf\nimport comfyui_a3b.prune.dense.llama_path\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def agreement(path: Path, n_windows: int = 16, seq_len: int = 256, keeps=(0.9, 0.8, 0.63)) -> dict:
    """How closely llama.cpp's statistics (graph callback on the quantised file) match the torch
    reference forward's (float32 on the dequantised weights) on the same calibration windows: per
    layer, the relative difference of the per-neuron mean squares and of the Gram matrices, and the
    overlap of the neurons Wanda keeps from each."""
    import numpy as np

    from ..prune.calibration import reference_stats as calibrate
    from ..prune.config import PruneConfig
    from ..prune.calibration.llama_stats import FFNInputProbe, LlamaCalibrator
    from ..prune.dense.methods import scores
    from ..prune.writing.align import width_for
    from ..prune.calibration.windows import calibration_windows
    from ..prune.calibration.windows import tokenizer as _tokenizer
    from ..prune.reference import RefModel
    from ..prune.source import SourceModel

    src = SourceModel(path)
    w, tok, bos = _tokenizer(src)
    try:
        wins, _ = calibration_windows(tok, bos, PruneConfig(calib_windows=n_windows, seq_len=seq_len))
    finally:
        w.free()
    probe = FFNInputProbe(src.hp.n_layer, gram_layers=range(src.hp.n_layer))
    t0 = time.perf_counter()
    with LlamaCalibrator(path, seq_len) as cal:
        cal.run([probe], wins)
    t_llama = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = calibrate.collect(RefModel.from_source(src), wins, src.sha256, progress=False)
    t_torch = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    rows = []
    for i in range(src.hp.n_layer):
        a, b = probe.layer_stats(i), ref.layers[i]
        down = src.weight(f"blk.{i}.ffn_down.weight")
        row = {"layer": i,
               "sumsq_rel": float(np.linalg.norm(a.sumsq - b.sumsq) / np.linalg.norm(b.sumsq)),
               "gram_rel": float(np.linalg.norm(a.gram - b.gram) / np.linalg.norm(b.gram))}
        sa, sb = scores("wanda", None, None, down, a, rng), scores("wanda", None, None, down, b, rng)
        for k in keeps:
            n = width_for(k, down.shape[1], 32)
            ka, kb = set(np.argsort(-sa)[:n]), set(np.argsort(-sb)[:n])
            row[f"wanda_overlap@{k:g}"] = len(ka & kb) / n
        rows.append(row)
    summary = {key: {"median": float(np.median([r[key] for r in rows])), "max": float(max(r[key] for r in rows)),
                     "min": float(min(r[key] for r in rows))} for key in rows[0] if key != "layer"}
    return {"windows": n_windows, "seq_len": seq_len, "llama_s": t_llama, "torch_s": t_torch, "layers": rows,
            "summary": summary}


def configs(model: str, keeps: list[float]) -> list[tuple[str, list[str]]]:
    out = []
    for k in keeps:
        out.append((f"llama:a3b@{k:g}", ["--keep", str(k), "--method", "a3b", "--calibration", "llama",
                                          "--recover-steps", "0"]))
        if model == "smollm2":
            out.append((f"torch:obs@{k:g}", ["--keep", str(k), "--method", "obs", "--calibration", "torch",
                                              "--recover-steps", "0"]))
            out.append((f"torch:a3b@{k:g}", ["--keep", str(k), "--method", "a3b", "--calibration", "torch",
                                              "--recover-steps", "0"]))
        if model == "gemma" and k < 1:
            out.append((f"llama:a3b@{k:g}/a32", ["--keep", str(k), "--method", "a3b", "--calibration", "llama",
                                                  "--recover-steps", "0", "--align", "32"]))
    return out


def options() -> argparse.ArgumentParser:
    ap = arguments(__doc__)
    ap.add_argument("--models", default="smollm2,gemma")
    ap.add_argument("--keeps", default="0.9,0.8,0.63")
    ap.add_argument("--heldout-windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--only", default="",
                    help="comma-separated configuration names to run (default: all); with --resume these are run "
                         "again and the other rows are kept")
    ap.add_argument("--decode-reps", type=int, default=11,
                    help="alternating decode runs per file (best of each side; more reps, steadier ratio)")
    ap.add_argument("--work", default=None, help="folder for the pruned files (default: a temporary one)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows of bench/results/bench_prune_llama.json whose settings match and run the "
                         "others (the unpruned file is measured again); models not in --models are kept as they are")
    ap.add_argument("--agreement-only", action="store_true",
                    help="only compare llama.cpp's and the torch reference's statistics on SmolLM2 "
                         "(bench/results/bench_prune_llama_agreement.json)")
    ap.add_argument("--plot-only", action="store_true", help="only draw the PNG from bench_prune_llama.json")
    return ap


def agreement_only() -> None:
    from ..runtime.models.locate import default_model_path

    ag = agreement(default_model_path())
    write_results("bench_prune_llama_agreement", {"model": default_model_path().name, **ag})
    print_table("llama.cpp vs torch reference statistics, SmolLM2 (per layer: median / max; overlap: min)",
                ["quantity", "median", "max", "min"],
                [[k, v["median"], v["max"], v["min"]] for k, v in ag["summary"].items()])
    print(f"seconds: llama.cpp {ag['llama_s']:.1f}, torch {ag['torch_s']:.1f}")


def row(model: str, name: str, c: dict) -> list:
    return [model, name, f"{c['n_ff']}/{c['n_ff_source']}", f"{c['bytes'] / 1e6:.1f}",
            *(f"{c['ratio'][k]:.3g}" for k in HELDOUT_SETS), f"{c['decode_ratio']:.2f}",
            f"{c['peak_rss'] / 1e6:.0f} ({c['rss_over_file']:.1f}x)", f"{c['wall_s']:.0f}"]


def unpruned(path: Path, args) -> tuple[dict, dict, list[int]]:
    """The model's entry (its file, size and held-out perplexity), the held-out windows, the decode prompt."""
    with LlamaEval(path, n_ctx=args.seq_len) as ev:
        sets = heldout(ev, args.heldout_windows, args.seq_len)
        base = {k: ev.perplexity(w) for k, w in sets.items()}
        prompt = ev.tokenize("def fibonacci(n):\n    ")
    size = path.stat().st_size
    m = {"file": path.name, "bytes": size, "ppl": base, "tokens": {k: sum(map(len, w)) for k, w in sets.items()},
         "configs": {}}
    return m, sets, prompt


def pruned(path: Path, out: Path, cli: list[str], cache: Path, m: dict, sets: dict, prompt: list[int], args) -> dict:
    """One configuration: pruned in a child, its held-out perplexity and decode speed as ratios."""
    from .bench_prune import decode_ratio

    r = run_prune(path, out, cli, cache)
    with LlamaEval(out, n_ctx=args.seq_len) as ev:
        ppl = {k: ev.perplexity(w) for k, w in sets.items()}
    sa, sb, ratio = decode_ratio(path, out, prompt, reps=args.decode_reps)
    s = r["summary"]
    return {"args": cli, "n_ff": s["n_ff"], "n_ff_source": s["n_ff_source"], "bytes": out.stat().st_size,
            "ppl": ppl, "ratio": {k: ppl[k] / m["ppl"][k] for k in ppl}, "decode_tps": [sa, sb],
            "decode_ratio": ratio, "peak_rss": r["peak_rss"], "rss_over_file": r["peak_rss"] / m["bytes"],
            "wall_s": r["wall_s"], "seconds": s["seconds"]}


def main(argv=None) -> int:
    from ..runtime.models.locate import default_model_path
    from .gemma import gemma_path

    args = options().parse_args(argv)
    if args.plot_only:
        draw_plot(json.loads((RESULTS / "bench_prune_llama.json").read_text()))
        return 0
    if args.agreement_only:
        agreement_only()
        return 0
    keeps = [float(x) for x in args.keeps.split(",")]
    only = set(filter(None, args.only.split(",")))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-prune-llama-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine(), "models": {}, "baseline_rss": baseline_rss(),
                     "command": "python -m comfyui_a3b.bench.bench_prune_llama " + " ".join(argv or sys.argv[1:])}
    old = {}
    prev_path = RESULTS / "bench_prune_llama.json"
    if args.resume and prev_path.is_file():
        old = json.loads(prev_path.read_text()).get("models", {})
        results["models"].update({k: v for k, v in old.items() if k not in args.models.split(",")})
    rows = []
    for model in args.models.split(","):
        path = default_model_path() if model == "smollm2" else gemma_path()
        m, sets, prompt = unpruned(path, args)
        results["models"][model] = m
        print(f"{model}: {path.name} {m['bytes'] / 1e6:.1f} MB, held-out perplexity "
              + ", ".join(f"{k} {v:.2f}" for k, v in m["ppl"].items()), flush=True)
        for name, cli in configs(model, keeps):
            was = old.get(model, {}).get("configs", {}).get(name)
            if only and name not in only and was is None:
                continue
            if (was is not None and was.get("args") == cli and old[model].get("tokens") == m["tokens"]
                    and not (only and name in only)):
                m["configs"][name] = was  # ratios against the unpruned file of that run
                rows.append(row(model, name, was))
                continue
            out = work / f"{model}-{name.replace(':', '-').replace('@', '-').replace('/', '-')}.gguf"
            m["configs"][name] = pruned(path, out, cli, work / "cache", m, sets, prompt, args)
            rows.append(row(model, name, m["configs"][name]))
            print(" | ".join(map(str, rows[-1])), flush=True)
            write_results("bench_prune_llama", results)
    print_table("One-shot pruning: llama.cpp calibration vs the torch path (ppl x = held-out perplexity ratio)",
                ["model", "config", "FFN", "MB", *(f"ppl {k} x" for k in HELDOUT_SETS), "decode x",
                 "peak RSS MB (x file)", "s"], rows)
    print(f"baseline RSS (python + torch + package imported): {results['baseline_rss'] / 1e6:.0f} MB")
    write_results("bench_prune_llama", results)
    draw_plot(results)
    return 0


def draw_plot(results: dict) -> None:
    def draw(ax):
        marks = {"smollm2": "o", "gemma": "s"}
        for model, m in results["models"].items():
            for name, c in m["configs"].items():
                r = math.exp(sum(math.log(v) for v in c["ratio"].values()) / len(c["ratio"]))
                ax.scatter(c["decode_ratio"], r, marker=marks.get(model, "x"),
                           color="C0" if name.startswith("llama") else "C1")
                ax.annotate(f"{model} {name}", (c["decode_ratio"], r), fontsize=6)
        ax.set_xlabel("decode speed vs unpruned (x)")
        ax.set_ylabel("held-out perplexity ratio (geometric mean of 4 sets)")
        ax.set_yscale("log")
        ax.set_title("one-shot pruning: llama.cpp (blue) vs torch (orange) calibration")

    plot("bench_prune_llama", draw)


if __name__ == "__main__":
    raise SystemExit(main())
