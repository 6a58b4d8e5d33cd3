"""Speculative decoding and sampling cost on a GPU at a real model shape, in one run.

    python -m comfyui_a3b.bench.bench_gpu_spec --out OUT --bin BIN          # Qwen3-8B shape, Q4_0
    python -m comfyui_a3b.bench.bench_gpu_spec --out /tmp/s --shape tiny    # a check on the CPU

1. Writes (or reuses) the random-weight GGUF of bench_gpu.py (Qwen3-8B's shape, Q4_0).
2. The runtime, fully offloaded, 16 slots, greedy: aggregate decode tokens/s at 1, 4 and 16
   concurrent requests without speculation, with n-gram lookup, and with the model as its own
   draft (every draft is accepted: the acceptance ceiling, and what drafting costs), with the
   drafted and accepted tokens of each.
3. Sampling: greedy and temperature 0.7 with top-k/top-p/min-p (no penalty), each drawn inside
   llama.cpp's graph (backend_sampling=auto: on the GPU) and by the CPU chain (backend_sampling=off),
   and temperature 0.7 with the sampling defaults (repeat penalty 1.1: the CPU chain either way);
   each row records the sampler its results name, and each sampled row is compared with greedy on
   the same path.
4. llama-batched-bench at 1, 4 and 16 sequences (decode speed, no sampling), when --bin has it.

Decode tokens/s count from the first request's first token to the last request's last token, as
llama-batched-bench counts its decode phase (`wall_tps` in the JSON: over the whole run, prompts
included); confidence spans are off (they need the CPU chain).

Random weights mean random text: n-gram lookup finds what the random model repeats, nothing more;
its acceptance here says nothing about real text (bench_speculative.py measures that on the CPU).
Every part that fails is recorded in the JSON with its error and the others still run. Writes
bench_gpu_spec.json, bench_gpu_spec.md and bench_gpu_spec.png into --out.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .bench_gpu import batched_bench, concurrent, gpu_layers
from .common import arguments, device_label, model_option
from .models import SHAPES, random_model

MODES = ("off", "ngram", "self-draft")
CONCURRENCY = (1, 4, 16)


def _spec(rt, path: Path, mode: str, n_slots: int = 16):
    speculative = f"draft:{path}" if mode == "self-draft" else mode
    return rt.spec(str(path), n_gpu_layers=gpu_layers(), n_ctx=640, n_parallel=n_slots, n_batch=512,
                   speculative=speculative, draft_max=8)


def _run(rt, spec, n: int, gen: int, sampling) -> dict:
    """`n` concurrent requests of `gen` tokens (bench_gpu.concurrent): decode tokens/s as
    llama-batched-bench counts it (`tps`), over the whole wall time (`wall_tps`), their drafts, and
    which sampler drew them."""
    rs, tps, wall_tps = concurrent(rt, spec, n, gen, sampling)
    return {"tps": tps, "wall_tps": wall_tps,
            "tokens": sum(r.n_tokens for r in rs), "drafted": sum(r.n_drafted_tokens for r in rs),
            "accepted": sum(r.n_accepted_tokens for r in rs),
            "sampler": ",".join(sorted({r.sampler or "?" for r in rs}))}


def speculation_rows(path: Path, gen: int) -> dict:
    from comfyui_a3b.runtime import Runtime, preset

    out = {}
    for mode in MODES:
        rt = Runtime()
        try:
            spec = _spec(rt, path, mode)
            _run(rt, spec, 1, 8, preset("greedy"))   # load and warm up
            out[mode] = {}
            for n in CONCURRENCY:
                out[mode][n] = _run(rt, spec, n, gen, preset("greedy"))
                print(f"  {mode} x{n}: {out[mode][n]['tps']:.0f} tokens/s, accepted {out[mode][n]['accepted']}"
                      f"/{out[mode][n]['drafted']}", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing mode is recorded, the others still run
            out[mode] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  {mode}: {out[mode]['error']}", flush=True)
        finally:
            rt.unload()
    return out


#: (row label, backend_sampling, sampling): each chain through llama.cpp's graph and through the CPU
#: chain, and the node defaults (a repeat penalty: the CPU chain either way)
def _chains():
    from comfyui_a3b.runtime import SamplingParams, preset

    t07 = SamplingParams(temperature=0.7, repeat_penalty=1.0, seed=1)
    return [("greedy, backend", "auto", preset("greedy")), ("greedy, CPU", "off", preset("greedy")),
            ("t0.7 no penalty, backend", "auto", t07), ("t0.7 no penalty, CPU chain", "off", t07),
            ("t0.7 defaults (CPU chain)", "auto", SamplingParams(temperature=0.7, seed=1))]


#: a sampled row -> the greedy row it is compared with (the same path)
GREEDY_OF = {"t0.7 no penalty, backend": "greedy, backend", "t0.7 no penalty, CPU chain": "greedy, CPU",
             "t0.7 defaults (CPU chain)": "greedy, CPU"}


def sampling_rows(path: Path, gen: int) -> dict:
    from comfyui_a3b.runtime import Runtime, preset

    out: dict = {}
    for mode in ("auto", "off"):   # one load at a time: backend chains attached (auto) or never (off)
        rt = Runtime()
        try:
            spec = rt.spec(_spec(rt, path, "off"), backend_sampling=mode)
            _run(rt, spec, 1, 8, preset("greedy"))
            for name, m, sp in _chains():
                if m != mode:
                    continue
                try:
                    out[name] = {n: _run(rt, spec, n, gen, sp) for n in CONCURRENCY}
                except Exception as e:  # noqa: BLE001 - one failing row is recorded, the others still run
                    out[name] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"  {name}: {out[name]['error']}", flush=True)
                    continue
                print(f"  {name}: " + ", ".join(f"x{n} {v['tps']:.0f} ({v['sampler']})" for n, v in out[name].items()),
                      flush=True)
        finally:
            rt.unload()
    return {name: out[name] for name, _, _ in _chains() if name in out}


def report(res: dict, out_dir: Path) -> None:
    bb = (res.get("batched_bench") or {}).get("rows") or {}

    def ref(n):
        return (bb.get(n) or bb.get(str(n)) or {}).get("speed_tg")

    lines = [f"# Speculative decoding and sampling, random {res['shape']} Q4_0 on {res.get('device')}", "",
             "| decode tokens/s (x llama-batched-bench) | " + " | ".join(f"{n} req" for n in CONCURRENCY)
             + " | wall tokens/s " + " / ".join(str(n) for n in CONCURRENCY)
             + " | accepted/drafted at 16, or sampler and x greedy |", "|---|" + "---|" * (len(CONCURRENCY) + 2)]
    series = {}

    def row(label, by_n, note=""):
        series[label] = {int(n): v["tps"] for n, v in by_n.items()}
        cells = []
        for n in CONCURRENCY:
            v = by_n.get(n) or by_n.get(str(n))
            r = ref(n)
            cells.append("-" if v is None else f"{v['tps']:.0f}" + (f" ({v['tps'] / r:.2f}x)" if r else ""))
        wall = " / ".join(f"{v['wall_tps']:.0f}" if v and "wall_tps" in v else "-"
                          for v in (by_n.get(n) or by_n.get(str(n)) for n in CONCURRENCY))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {wall} | {note} |")

    def failed(name, by_n) -> bool:
        if not isinstance(by_n, dict) or "error" in by_n or "skipped" in by_n:
            why = by_n if not isinstance(by_n, dict) else by_n.get("error") or by_n.get("skipped")
            lines.append(f"| {name} | {str(why)[:120]} |")
            return True
        return False

    for mode, by_n in (res.get("speculation") or {}).items():
        if failed(mode, by_n):
            continue
        last = by_n.get(16) or by_n.get("16") or {}
        row(f"greedy, speculative={mode}", by_n, f"{last.get('accepted', 0)}/{last.get('drafted', 0)}")
    samp = res.get("sampling") or {}
    for name, by_n in samp.items():
        if failed(name, by_n):
            continue
        greedy = samp.get(GREEDY_OF.get(name, ""), {})
        # which sampler the results named, then each sampled row against greedy on its own path
        note = "sampler " + "/".join(sorted({v.get("sampler", "?") for v in by_n.values()}))
        if isinstance(greedy, dict) and greedy and "error" not in greedy:
            note += "; " + ", ".join(f"x{n}: {by_n[n]['tps'] / greedy[n]['tps']:.2f} of {GREEDY_OF[name]}"
                                     for n in CONCURRENCY if n in by_n and n in greedy)
        row(name, by_n, note)
    if bb:
        lines.append("| llama-batched-bench | " + " | ".join(f"{ref(n):.0f}" if ref(n) else "-" for n in CONCURRENCY)
                     + " | |")
    text = "\n".join(lines)
    print(text, flush=True)
    (out_dir / "bench_gpu_spec.md").write_text(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, by_n in series.items():
        ns = sorted(by_n)
        ax.plot(ns, [by_n[n] for n in ns], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(CONCURRENCY), [str(n) for n in CONCURRENCY])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tokens/s (all requests)")
    ax.set_title(f"random {res['shape']} Q4_0 on {res.get('device')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "bench_gpu_spec.png", dpi=120)


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--out", required=True, help="folder for the results (and the model, unless --model)")
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    model_option(ap, help="an existing GGUF instead of writing a random one")
    ap.add_argument("--bin", help="folder with llama-batched-bench")
    ap.add_argument("--gen", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--only", default="speculation,sampling,tools", help="which parts to run (comma list)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = set(args.only.split(","))
    res: dict = {"shape": args.shape, "gen": args.gen, "command": " ".join(sys.argv)}
    res["device"] = device_label()
    path, took = random_model(args.model, out_dir / f"random-{args.shape}.q4_0.gguf", args.shape)
    if took is not None:
        res["write_model_s"] = took

    def step(name, fn):
        t0 = time.perf_counter()
        print(f"{name} ...", flush=True)
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - a failing part is reported, the others still run
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        res.setdefault("seconds", {})[name] = time.perf_counter() - t0
        (out_dir / "bench_gpu_spec.json").write_text(json.dumps(res, indent=2, default=str))
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)

    if "speculation" in parts:
        step("speculation", lambda: speculation_rows(path, args.gen))
    if "sampling" in parts:
        step("sampling", lambda: sampling_rows(path, args.gen))
    if "tools" in parts:
        if args.bin and (Path(args.bin) / "llama-batched-bench").exists():
            step("batched_bench", lambda: batched_bench(Path(args.bin) / "llama-batched-bench", path, args.gen))
        else:
            res["batched_bench"] = {"skipped": "no llama-batched-bench (--bin)"}
    (out_dir / "bench_gpu_spec.json").write_text(json.dumps(res, indent=2, default=str))
    report(res, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
