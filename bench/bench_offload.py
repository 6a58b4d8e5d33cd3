"""Expert offload under VRAM budgets: the planner's placement against layer-only offload and llama.cpp.

    python3 -m comfyui_a3b.bench.bench_offload --out DIR --bin BIN                 # Qwen3-30B-A3B shape
    python3 -m comfyui_a3b.bench.bench_offload --out DIR --shape tiny-moe          # a check on the CPU

1. Writes a random-weight Q4_0 qwen3moe GGUF at Qwen3-30B-A3B's shape (models.write_model,
   about 17 GB; `--model FILE` reuses one).
2. The planner's table (pure, no load): for each budget, what the planner chooses for the file, what
   layer-only offload would keep on the GPU, and the same for the file with 0.75 of its experts (as
   `a3b prune --experts-keep 0.75` leaves it; its layout derived from the file's, nothing written).
3. For each budget (GB of free device memory, `--budgets 4,8,12,24`): a child process allocates the
   rest of the card with torch and holds it, so llama.cpp, the planner and llama.cpp's tools all see
   only that much free (without torch or a GPU the budget is not enforced, and said so). Then
   (a) the runtime with the planner's choice (`n_gpu_layers` auto), (b) the runtime with layer-only
   offload (the layer count today's planner picks for the same free memory), (c) llama-batched-bench
   from `--bin` with the same placement as (a) (`-ngl`, `--n-cpu-moe`) and as (b): decode tokens/s of 1 and 4
   concurrent requests (the runtime counted from the first token to the last, as the tool counts its decode
   phase; `wall`: over the whole run, prompts included) and prefill tokens/s of one 512-token prompt;
   predicted and measured device memory (free before and after the load); the CPU threads of one
   token and of 4 requests' tokens (the runtime's tuner's pick and its milliseconds per token for
   each count; the threadpools attached).
4. At the largest budget, a hand-over as ComfyUI asks for it (runtime/models/handover.py): give 4 GB back
   by a smaller placement, the seconds it took, decode speed after.
5. With ComfyUI's sources (`--comfyui DIR`, or $COMFYUI_DIR), under the largest budget, in a child
   process: ComfyUI's real model management loading a diffusion-model-sized ModelPatcher beside the
   LLM, the hand-over it triggers, generations in between (bench_offload_comfy.py).

Every sub-measurement that fails is recorded with its error and the run goes on. Writes
bench_offload.json, .md and (with matplotlib) .png into --out.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from .common import arguments, machine, model_option

GIB = 1 << 30
#: the child that takes all device memory but `budget` bytes and holds it until its stdin closes
HOLDER = r"""
import sys, torch
budget = int(sys.argv[1])
torch.cuda.init()
free, total = torch.cuda.mem_get_info()
take = max(free - budget, 0)
x = torch.empty(take, dtype=torch.uint8, device="cuda") if take else None
print("HELD", take, torch.cuda.mem_get_info()[0], flush=True)
sys.stdin.read()
"""


def say(*a) -> None:
    print(*a, flush=True)


class Budget:
    """Device memory held by a torch child so that about `gb` GB stay free (a no-op without torch/GPU)."""

    def __init__(self, gb: float):
        self.gb, self.proc, self.note, self.free_after = gb, None, "", None

    def __enter__(self):
        from comfyui_a3b.runtime.llama.devices import gpu_free_bytes

        if gpu_free_bytes() is None:
            self.note = "not enforced: no GPU"
            return self
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(int(self.gb * 1e9))], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
            line = self.proc.stdout.readline()
            if not line.startswith("HELD"):
                raise RuntimeError(f"the torch holder said {line!r}")
            self.free_after = gpu_free_bytes()
            self.note = f"held {int(line.split()[1]) / GIB:.1f} GiB with torch; {self.free_after / GIB:.2f} GiB free"
        except Exception as e:  # noqa: BLE001 - recorded; the budget is then the whole card
            self.note = f"not enforced: {type(e).__name__}: {e}"
            self._stop()
        return self

    def _stop(self):
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                self.proc.kill()
            self.proc = None

    def __exit__(self, *exc):
        self._stop()


def pruned_layout(lay, keep: float):
    """The layout of the same model with `keep` of its experts (expert tensors scaled; nothing written)."""
    from comfyui_a3b.runtime.llama.planner import Layout

    tensors = tuple(replace(t, nbytes=int(t.nbytes * keep)) if t.movable else t for t in lay.tensors)
    return Layout(**{**lay.__dict__, "tensors": tensors})


def planner_table(path: Path, budgets: list[float], args) -> list[dict]:
    from comfyui_a3b.runtime.llama import placement, planner

    lay = placement.layout(path)
    kw = dict(n_ctx=args.n_ctx, n_parallel=4, n_batch=512, kv_type="f16", flash_attn="auto")
    rows = []
    for gb in budgets:
        free = int(gb * 1e9)
        row = {"budget_gb": gb}
        for key, layout in (("file", lay), ("experts_keep_0.75", pruned_layout(lay, 0.75))):
            p = planner.plan(layout, free_bytes=free, **kw)
            lo = planner.layer_only(layout, free_bytes=free, **kw)
            row[key] = {"n_gpu_layers": p.n_gpu_layers, "n_cpu_moe": p.n_cpu_moe, "gpu_gib": p.gpu_bytes / GIB,
                        "speed": p.speed, "layer_only_gpu_layers": lo.n_gpu_layers}
        rows.append(row)
    return rows


def prompt(n: int, offset: int = 0) -> list[int]:
    from .models import prompt as p

    return p(n, offset)


def runtime_run(path: Path, n_gpu_layers, args) -> dict:
    """Load with `n_gpu_layers` ("auto" = the planner), decode 1 and 4 requests, prefill 512 tokens."""
    from comfyui_a3b.runtime import ConfidenceConfig, Runtime, preset
    from comfyui_a3b.runtime.llama.backend import thread_counts

    from .bench_gpu import concurrent

    rt = Runtime()
    spec = rt.spec(str(path), n_gpu_layers=n_gpu_layers, n_ctx=args.n_ctx, n_parallel=4, n_batch=512,
                   speculative=args.speculative)
    t0 = time.perf_counter()
    m = rt.load(spec)
    out = {"load_s": time.perf_counter() - t0, "offload": m.info.offload, "n_gpu_layers": m.info.n_gpu_layers,
           "n_cpu_moe": m.info.n_cpu_moe, "threads": list(thread_counts(0)), "placement": m.info.placement}
    greedy, off = preset("greedy"), ConfidenceConfig(enabled=False)
    rt.generate(prompt_tokens=prompt(16), model=spec, chat=False, max_tokens=4, sampling=greedy, confidence=off)

    for n in (1, 4):   # decode counted as llama-batched-bench counts it; wall: prompts included
        runs = [concurrent(rt, spec, n, args.gen, greedy)[1:] for _ in range(args.reps)]
        out[f"decode_tps_{n}"] = max(d for d, _ in runs)
        out[f"wall_tps_{n}"] = max(w for _, w in runs)
    out["threads_used"] = threads_used(m.backend)
    t = time.perf_counter()
    r = rt.generate(prompt_tokens=prompt(511, 7), model=spec, chat=False, max_tokens=1, sampling=greedy, confidence=off)
    out["prefill_tps"] = r.n_prompt_tokens / (time.perf_counter() - t)
    if args.handover and n_gpu_layers == "auto":
        out["handover"] = handover_run(rt, spec, args)
    rt.unload()
    return out


def threads_used(backend) -> dict:
    """The threads of one token and of 4 requests' tokens (the tuner's pick from what it measured),
    the tuner's milliseconds per token by thread count, and the threadpools attached."""
    from comfyui_a3b.runtime.llama import system_info
    from comfyui_a3b.runtime.llama.threadtune import size_class

    tuner, pools = backend.tuner, getattr(backend, "pools", None)
    four = {t: c for (size, t), c in tuner.cost.items() if size == size_class(4)}
    return {"decode": tuner.decode, "batch_4": min(four, key=four.__getitem__) if four else tuner.decode,
            "prompt": tuner.prompt, "ms_per_token_4": {str(t): round(c * 1e3, 3) for t, c in four.items()},
            "pools": list(pools.sizes) if pools else None, "openmp": "OPENMP = 1" in system_info()["system_info"]}


def handover_run(rt, spec, args) -> dict:
    from comfyui_a3b.runtime import preset
    from comfyui_a3b.runtime.models import handover
    from comfyui_a3b.runtime.generation import ConfidenceConfig

    res = handover.give_back(rt, spec, int(args.handover * 1e9))
    if res is None:
        return {"result": "no smaller placement (would unload)"}
    t = time.perf_counter()
    r = rt.generate(prompt_tokens=prompt(16, 3), model=spec, chat=False, max_tokens=args.gen,
                    sampling=preset("greedy"), confidence=ConfidenceConfig(enabled=False))
    res["decode_tps_1_after"] = r.n_tokens / (time.perf_counter() - t)
    res["placement_after"] = rt.loaded(spec).info.placement
    return res


def _rows(text: str) -> dict:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            rows[int(cells[2])] = {"speed_tg": float(cells[7]), "speed_pp": float(cells[5])}
    return rows


def tool_run(binary: Path, path: Path, n_gpu_layers: int, n_cpu_moe: int, threads: list[int], args) -> dict:
    """llama-batched-bench with the placement given: decode at 1 and 4, prefill of 512 tokens."""
    place = ["-ngl", str(n_gpu_layers)] + (["--n-cpu-moe", str(n_cpu_moe)] if n_cpu_moe else [])
    common = [str(binary), "-m", str(path), *place, "-t", str(threads[0]), "-tb", str(threads[1]), "-b", "512",
              "-ub", "512"]
    cmd = common + ["-c", str(4 * (32 + args.gen) + 64), "-npp", "32", "-ntg", str(args.gen), "-npl", "1,4"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    rows = _rows(p.stdout + p.stderr)
    pp = subprocess.run(common + ["-c", "1024", "-npp", "512", "-ntg", "1", "-npl", "1"], capture_output=True,
                        text=True, timeout=300)
    pre = _rows(pp.stdout + pp.stderr)
    out = {"command": " ".join(cmd), "threads_used": {"decode": threads[0], "batch_4": threads[1]},
           "decode_tps_1": rows.get(1, {}).get("speed_tg"),
           "decode_tps_4": rows.get(4, {}).get("speed_tg"), "prefill_tps": pre.get(1, {}).get("speed_pp")}
    if not rows:
        out["error"] = (p.stdout + p.stderr)[-1200:]
    return out


def attempt(fn, *a) -> dict:
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - one failing measurement must not end the run
        say(f"  failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"}


def measure(path: Path, budgets: list[float], args, deadline: float) -> list[dict]:
    from comfyui_a3b.runtime.llama import placement, planner
    from comfyui_a3b.runtime.llama.devices import gpu_free_bytes

    binary = Path(args.bin) / "llama-batched-bench" if args.bin else None
    out = []
    for gb in budgets:
        row: dict = {"budget_gb": gb}
        if time.perf_counter() > deadline:
            row["skipped"] = f"over --max-seconds {args.max_seconds}"
            out.append(row)
            continue
        with Budget(gb) as b:
            row["budget"] = b.note
            say(f"budget {gb} GB: {b.note}")
            row["planner"] = attempt(runtime_run, path, "auto", args)
            say(f"  planner: {row['planner'].get('offload', row['planner'].get('error'))}")
            free = gpu_free_bytes() or 0
            lo = planner.layer_only(placement.layout(path), free_bytes=free, n_ctx=args.n_ctx, n_parallel=4,
                                    n_batch=512)
            row["layer_only"] = (attempt(runtime_run, path, lo.n_gpu_layers if free else 0, args) if args.layer_only
                                 else {"error": "skipped (--no-layer-only)"})
            say(f"  layer-only: {row['layer_only'].get('offload', row['layer_only'].get('error'))}")
            a = row["planner"]
            if binary is None or not binary.exists():
                row["llama_cpp"] = {"skipped": f"no llama-batched-bench in --bin ({args.bin})"}
            elif "error" in a:
                row["llama_cpp"] = {"skipped": "the planner's run failed"}
            else:
                row["llama_cpp"] = attempt(tool_run, binary, path, a["n_gpu_layers"], a["n_cpu_moe"], a["threads"],
                                           args)
                if "error" not in row["layer_only"] and (row["layer_only"]["n_gpu_layers"], 0) != (
                        a["n_gpu_layers"], a["n_cpu_moe"]):
                    # llama.cpp's own tool at the layer-only placement too: its ratio planner/layer-only
                    # says what the placement buys, apart from this runtime
                    row["llama_cpp_layer_only"] = attempt(tool_run, binary, path, row["layer_only"]["n_gpu_layers"],
                                                          0, row["layer_only"]["threads"], args)
                if args.sweep and "error" not in row["llama_cpp"]:
                    row["sweep"] = sweep(binary, path, a, args)
            say(f"  llama.cpp: {json.dumps({k: v for k, v in row['llama_cpp'].items() if k != 'command'})[:300]}")
        out.append(row)
    return out


def sweep(binary: Path, path: Path, planned: dict, args) -> dict:
    """llama-batched-bench at n_cpu_moe values around the planner's, under the same budget: a value
    that does not fit fails to load (recorded so); the best that fits, against the planner's."""
    from comfyui_a3b.runtime.llama import placement

    n_layer = placement.layout(path).n_layer
    base = planned["n_cpu_moe"]
    rows = {}
    for off in (int(x) for x in args.sweep.split(",")):
        n = base + off
        if off == 0 or not 0 <= n <= n_layer:
            continue
        r = attempt(tool_run, binary, path, planned["n_gpu_layers"], n, planned["threads"], args)
        rows[n] = {k: r.get(k) for k in ("decode_tps_1", "decode_tps_4", "error") if r.get(k) is not None}
        say(f"  sweep n_cpu_moe {n}: {rows[n]}")
    return {"planner_n_cpu_moe": base, "rows": rows}


def comfyui_run(path: Path, gb: float, args) -> dict:
    """bench_offload_comfy in a child process (torch and ComfyUI there), under the budget `gb`."""
    with Budget(gb) as b, tempfile.TemporaryDirectory() as d:
        say(f"ComfyUI beside the LLM, budget {gb} GB: {b.note}")
        res_path = Path(d) / "comfy.json"
        p = subprocess.run([args.comfyui_python, "-m", "comfyui_a3b.bench.bench_offload_comfy", "--comfyui",
                            args.comfyui, "--model", str(path), "--diffusion-gb", str(args.diffusion_gb), "--n-ctx",
                            str(args.n_ctx), "--out", str(res_path)], capture_output=True, text=True, timeout=300)
        say(p.stdout[-3000:])
        if not res_path.exists():
            return {"error": (p.stdout + p.stderr)[-2000:], "budget": b.note}
        return {**json.loads(res_path.read_text()), "budget": b.note}


def table(res: dict) -> str:
    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    lines = ["| budget | mode | placement | GPU GiB predicted / measured | threads 1 / 4 req | decode 1 | decode 4 | "
             "wall 1 / 4 | prefill | x layer-only (1 / 4) | x llama.cpp (1 / 4) |", "|" + "---|" * 11]

    def ratio(x: dict, y: dict, n: int):
        return x[f"decode_tps_{n}"] / y[f"decode_tps_{n}"] if x.get(f"decode_tps_{n}") and y.get(
            f"decode_tps_{n}") else None

    def cell(pair) -> str:
        return "-" if not pair else f"{f(ratio(*pair, 1), '{:.2f}x')} / {f(ratio(*pair, 4), '{:.2f}x')}"

    for r in res["runs"]:
        a, lo, tool = r.get("planner", {}), r.get("layer_only", {}), r.get("llama_cpp", {})
        tool_lo = r.get("llama_cpp_layer_only", {})
        for mode, x in (("planner", a), ("layer-only", lo), ("llama-batched-bench", tool),
                        ("llama-batched-bench, layer-only", tool_lo)):
            if mode.endswith("layer-only") and mode != "layer-only" and not x:
                continue
            pl = x.get("placement", {})
            pred, meas = pl.get("gpu_bytes"), pl.get("measured", {}).get("gpu_bytes")
            where = (f"ngl {x.get('n_gpu_layers')}, n_cpu_moe {x.get('n_cpu_moe')}" if "n_gpu_layers" in x
                     else x.get("error", x.get("skipped", "same as " + ("layer-only" if "layer" in mode
                                                                         else "planner")))[:60])
            # the planner against layer-only offload (ours, and llama.cpp's tool at both placements);
            # the runtime against the tool at the same placement
            vs_lo = {"planner": (a, lo), "llama-batched-bench": (tool, tool_lo)}.get(mode)
            vs_tool = {"planner": (a, tool), "layer-only": (lo, tool_lo)}.get(mode)
            th = x.get("threads_used", {})
            lines.append(f"| {r['budget_gb']} GB | {mode} | {where} | {f(pred and pred / GIB, '{:.2f}')} / "
                         f"{f(meas and meas / GIB, '{:.2f}')} | {th.get('decode', '-')} / {th.get('batch_4', '-')} | "
                         f"{f(x.get('decode_tps_1'))} | {f(x.get('decode_tps_4'))} | "
                         f"{f(x.get('wall_tps_1'))} / {f(x.get('wall_tps_4'))} | "
                         f"{f(x.get('prefill_tps'), '{:.0f}')} | {cell(vs_lo)} | {cell(vs_tool)} |")
    sweeps = [(r["budget_gb"], r["sweep"], r.get("llama_cpp", {})) for r in res["runs"] if r.get("sweep")]
    if sweeps:
        lines += ["", "| budget | llama-batched-bench at n_cpu_moe: decode 1 / 4 requests | planner's / best that fits "
                      "(1 / 4) |", "|---|---|---|"]
        for gb, sw, tool in sweeps:
            rows = {int(n): v for n, v in sw["rows"].items()}
            rows[sw["planner_n_cpu_moe"]] = {"decode_tps_1": tool.get("decode_tps_1"),
                                             "decode_tps_4": tool.get("decode_tps_4")}
            cells = ", ".join(f"{n}{'*' if n == sw['planner_n_cpu_moe'] else ''}: "
                              + (f"{f(v.get('decode_tps_1'))} / {f(v.get('decode_tps_4'))}" if "error" not in v
                                 else "does not fit") for n, v in sorted(rows.items()))
            fits = [v for v in rows.values() if "error" not in v and v.get("decode_tps_4")]
            best1 = max((v["decode_tps_1"] for v in fits if v.get("decode_tps_1")), default=None)
            best4 = max((v["decode_tps_4"] for v in fits), default=None)
            mine = rows[sw["planner_n_cpu_moe"]]
            lines.append(f"| {gb} GB | {cells} | "
                         f"{f(best1 and mine.get('decode_tps_1') and mine['decode_tps_1'] / best1, '{:.2f}')} / "
                         f"{f(best4 and mine.get('decode_tps_4') and mine['decode_tps_4'] / best4, '{:.2f}')} |")
    lines += ["", "| budget | planner (file) | planner (experts-keep 0.75) | layer-only GPU layers (file / 0.75) |",
              "|---|---|---|---|"]
    for r in res["planner_table"]:
        a, b = r["file"], r["experts_keep_0.75"]
        lines.append(f"| {r['budget_gb']} GB | ngl {a['n_gpu_layers']}, n_cpu_moe {a['n_cpu_moe']} "
                     f"({a['gpu_gib']:.1f} GiB) "
                     f"| ngl {b['n_gpu_layers']}, n_cpu_moe {b['n_cpu_moe']} ({b['gpu_gib']:.1f} GiB) "
                     f"| {a['layer_only_gpu_layers']} / {b['layer_only_gpu_layers']} |")
    c = res.get("comfyui", {})
    if c and "diffusion_load" in c:
        lines += ["", f"ComfyUI ({c.get('device')}, {c.get('budget')}): diffusion model {c.get('diffusion_gb')} GB", "",
                  "| step | seconds | LLM placement | decode tokens/s | hand-overs | error |",
                  "|---|---|---|---|---|---|"]
        for k in ("llm_load", "diffusion_load", "llm_generate", "diffusion_again", "llm_again"):
            s = c.get(k, {})
            llm = s.get("llm", s)
            lines.append(f"| {k} | {f(s.get('seconds'), '{:.2f}')} | {str(llm.get('offload', '-'))[:90]} | "
                         f"{f(s.get('decode_tps'))} | {len(s.get('handovers', []))} | {s.get('error', '')[:80]} |")
    elif c:
        lines += ["", f"ComfyUI: {c.get('skipped') or c.get('error', '')[:300]}"]
    return "\n".join(lines)


def draw_png(res: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["budget_gb"] for r in res["runs"]]
    for key, label in (("planner", "planner (a3b)"), ("layer_only", "layer-only (a3b)"),
                       ("llama_cpp", "llama-batched-bench")):
        ys = [r.get(key, {}).get("decode_tps_1") for r in res["runs"]]
        if any(y for y in ys):
            ax.plot(xs, [y or float("nan") for y in ys], marker="o", label=label)
    ax.set_xlabel("free device memory (GB)")
    ax.set_ylabel("decode tokens/s, 1 request")
    ax.set_title(f"random {res['shape']} Q4_0, expert offload")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    from .models import SHAPES, write_model

    ap = arguments(__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bin", default=os.environ.get("BIN"), help="folder with llama-batched-bench")
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b")
    model_option(ap, help="an existing GGUF of that shape instead of writing one")
    ap.add_argument("--budgets", default="4,8,12,24", help="free device memory per run, GB")
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--speculative", default="auto", help="the runtime's speculative setting (off: decode as the "
                                                           "tool does, one token per request and step)")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--handover", type=float, default=4.0, help="GB to give back at the largest budget (0: off)")
    ap.add_argument("--max-seconds", type=float, default=300, help="no new budget starts after this")
    ap.add_argument("--sweep", default="", help="n_cpu_moe offsets from the planner's to run llama-batched-bench at "
                                                "too, e.g. -2,-1,1,2 (none by default)")
    ap.add_argument("--no-layer-only", dest="layer_only", action="store_false",
                    help="skip the runtime's layer-only run")
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_DIR"), help="ComfyUI's sources (step 5)")
    ap.add_argument("--comfyui-python", default=sys.executable, help="the Python with torch for step 5")
    ap.add_argument("--diffusion-gb", type=float, default=5.1)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("A3B_VET", "off")   # the file is written here
    budgets = [float(x) for x in args.budgets.split(",")]
    tmp = None
    if args.model:
        path = Path(args.model)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="a3b-offload-", dir=os.environ.get("TMPDIR")))
        path = tmp / f"{args.shape}.gguf"
        t = time.perf_counter()
        say(f"writing {path} ...")
        write_model(path, SHAPES[args.shape])
        say(f"wrote {path.stat().st_size / GIB:.1f} GiB in {time.perf_counter() - t:.0f} s")
    res = {"shape": args.shape, "machine": machine(), "args": vars(args), "file_bytes": path.stat().st_size}
    try:
        res["planner_table"] = planner_table(path, budgets, args)
        ho, deadline = args.handover, time.perf_counter() + args.max_seconds
        res["runs"] = []
        for i, gb in enumerate(budgets):
            args.handover = ho if i == len(budgets) - 1 else 0   # the hand-over at the largest budget only
            res["runs"] += measure(path, [gb], args, deadline)
        res["comfyui"] = attempt(comfyui_run, path, max(budgets), args) if args.comfyui else {
            "skipped": "no ComfyUI sources (--comfyui or $COMFYUI_DIR)"}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    (out / "bench_offload.json").write_text(json.dumps(res, indent=2, default=str))
    md = table(res)
    (out / "bench_offload.md").write_text(md + "\n")
    say(md)
    png = draw_png(res, out / "bench_offload.png")
    say(f"wrote {out / 'bench_offload.json'}, .md{', .png' if png else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
