"""Speculative decoding on the CPU: the embedded model with n-gram drafts vs without, in one run.

    python -m comfyui_a3b.bench.bench_speculative [--repeats 3] [--serve-as as-is]

Tasks (each run alternately without and with speculation, so machine noise hits both alike):

* **rewrite**: a real function from a held-out source (packaging's `canonicalize_version`, a file
  no test reads) to be written out again with one identifier renamed: most of the answer is in the
  prompt, the best case for n-gram lookup.
* **next line**: an editor's fill-in-the-middle completion in the middle of a real module, at
  interactive priority (the request the language server sends; its transport is left out).
* **chat**: a plain question whose answer does not repeat the prompt: speculation must cost
  nothing there.

Reports decode tokens/s (the median over the repeats, first to last token) and the ratio of the
two modes, the drafted and accepted tokens, and whether the tokens were the same (greedy). Writes
bench/results/speculative.json and .png.
"""
from __future__ import annotations

import inspect
import statistics
import textwrap

from .common import arguments, plot, print_table, write_results

RENAME = ("version", "ver")


def rewrite_prompt() -> str:
    import packaging.utils as source   # read as text: a held-out source

    src = textwrap.dedent(inspect.getsource(source.canonicalize_version))
    old, new = RENAME
    head = src.split("\n")[0].replace(old, new)
    return f"Original code:\n```python\n{src}```\n\nThe same code with `{old}` renamed to `{new}`:\n```python\n{head}\n"


def next_line_prompt():
    import packaging.specifiers as source

    from comfyui_a3b.runtime import InfillPrompt

    src = inspect.getsource(source)
    cut = src.index("\n", len(src) // 2) + 1
    return InfillPrompt(prefix=src[max(0, cut - 3000):cut], suffix=src[cut:cut + 1000])


def tasks():
    from comfyui_a3b.runtime import PRIORITY_INTERACTIVE

    return {
        "rewrite": dict(prompt=rewrite_prompt(), chat=False, max_tokens=200, stop=["```"]),
        "next line": dict(prompt=next_line_prompt(), max_tokens=48, priority=PRIORITY_INTERACTIVE),
        "chat": dict(prompt="Why is the sky blue? Answer in a short paragraph.", max_tokens=120),
    }


def measure(rt, task: dict, mode: str, serve_as: str) -> dict:
    from comfyui_a3b.runtime import ConfidenceConfig, preset

    spec = rt.spec(None, speculative=mode, n_parallel=2, serve_as=serve_as)
    kw = dict(task)
    r = rt.submit(kw.pop("prompt"), model=spec, sampling=preset("greedy"), confidence=ConfidenceConfig(enabled=False),
                  **kw).result()
    return {"tps": r.tokens_per_second, "n_tokens": r.n_tokens, "drafted": r.n_drafted_tokens,
            "accepted": r.n_accepted_tokens, "tokens": r.tokens, "decode_s": r.decode_time}


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve-as", default="as-is", help="the serving format (LoadSpec.serve_as) of both modes")
    ap.add_argument("--only", help="comma list of tasks (default: all)")
    args = ap.parse_args(argv)
    from comfyui_a3b.runtime import Runtime

    rt = Runtime()
    all_tasks = tasks()
    names = args.only.split(",") if args.only else list(all_tasks)
    for mode in ("off", "ngram"):   # load both and warm up
        measure(rt, dict(all_tasks["chat"], max_tokens=4), mode, args.serve_as)
    res: dict = {"serve_as": args.serve_as, "repeats": args.repeats, "tasks": {}}
    rows = []
    for name in names:
        runs: dict[str, list[dict]] = {"off": [], "ngram": []}
        for _ in range(args.repeats):
            for mode in ("off", "ngram"):
                runs[mode].append(measure(rt, all_tasks[name], mode, args.serve_as))
                print(name, mode, f"{runs[mode][-1]['tps']:.1f} tokens/s", flush=True)
        med = {m: statistics.median(x["tps"] for x in v) for m, v in runs.items()}
        same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["off"], runs["ngram"]))
        last = runs["ngram"][-1]
        res["tasks"][name] = {"tps_off": med["off"], "tps_ngram": med["ngram"], "ratio": med["ngram"] / med["off"],
                              "n_tokens": last["n_tokens"], "drafted": last["drafted"], "accepted": last["accepted"],
                              "same_tokens": same,
                              "runs": {m: [{k: v for k, v in x.items() if k != "tokens"} for x in xs]
                                       for m, xs in runs.items()}}
        t = res["tasks"][name]
        rows.append([name, t["n_tokens"], t["tps_off"], t["tps_ngram"], t["ratio"], f"{t['accepted']}/{t['drafted']}",
                     "yes" if same else "NO"])
    cost = rt.load(rt.spec(None, speculative="ngram", n_parallel=2, serve_as=args.serve_as)).step_cost
    # what an extra token costs in a step, as a fraction of the step: speculation pays only well below 1
    res["extra_token_cost"] = cost.extra
    res["step_s"] = cost.base
    rt.unload()
    print(f"an extra token costs {cost.extra:.2f} of a decode step here", flush=True)
    print_table("Speculative decoding (n-gram lookup) vs none, embedded model, greedy",
                ["task", "tokens", "tok/s off", "tok/s ngram", "ratio", "accepted/drafted", "same tokens"], rows)
    write_results("speculative", res)

    def draw(ax):
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r[2] for r in rows], 0.4, label="no speculation")
        ax.bar([x + 0.2 for x in xs], [r[3] for r in rows], 0.4, label="n-gram lookup")
        ax.set_xticks(list(xs), [r[0] for r in rows])
        ax.set_ylabel("decode tokens/s")
        ax.set_title("Speculative decoding, embedded model (CPU)")
        ax.legend()

    plot("speculative", draw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
