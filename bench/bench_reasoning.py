"""Structured output and the reasoning budget on the embedded model, in one run.

    python -m comfyui_a3b.bench.bench_reasoning [--tokens 160] [--rounds 5]

* **Grammar speed.** Decode tokens/s of a storyboard answer constrained by a JSON schema (llguidance's
  matcher, as runtime/llama/grammar.py applies it) against the same prompt unconstrained,
  alternating request by request, greedy and sampled; the ratio is the median of the pairs' ratios.
  The target is 0.8x or better.
* **Budget overshoot.** The embedded model with a chat template that opens the reasoning block in
  the generation prompt (DeepSeek-R1 style), so it reasons until the runtime closes the block: for
  each budget, the reasoning tokens read before the block closed, minus the budget (target 0), for
  requests alone and four at once in one batch.

Writes bench/results/reasoning.json and reasoning.png.
"""
from __future__ import annotations

import tempfile
import threading
from pathlib import Path

from .common import arguments, median, plot, print_table, with_chat_template, write_results

PROMPT = "Write a storyboard for a comic about a lighthouse keeper who finds a message in a bottle."
#: six panels, so that the constrained answer is as long as the free one (the rates compare like with like)
PANELS = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
    "type": "object", "required": ["panel", "scene", "dialogue"],
    "properties": {"panel": {"type": "integer"}, "scene": {"type": "string"}, "dialogue": {"type": "string"}}}}
#: DeepSeek-R1's shape (the generation prompt opens the block), for the budget rows
R1_SHAPE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n<think>\n")
BUDGETS = (0, 8, 32, 128)


def grammar_speed(rt, tokens: int, rounds: int) -> list[dict]:
    from ..runtime import preset

    rows = []
    for name, sampling in (("greedy", preset("greedy")), ("sampled", preset("default", seed=3))):
        free, schema, n = [], [], []
        rt.generate(PROMPT, max_tokens=8, sampling=sampling)   # warm: the prompt's KV is cached for all
        for _ in range(rounds):
            a = rt.generate(PROMPT, max_tokens=tokens, sampling=sampling)
            b = rt.generate(PROMPT, max_tokens=tokens, sampling=sampling, json_schema=PANELS)
            free.append(a.tokens_per_second)
            schema.append(b.tokens_per_second)
            n.append(b.n_tokens)
        # the median of each pair's ratio: a pair runs back to back, so the load of a shared machine,
        # which drifts over seconds, cancels out of it
        rows.append({"sampling": name, "free_tps": median(free), "schema_tps": median(schema),
                     "ratio": median([b / a for a, b in zip(free, schema)]), "schema_tokens": median(n)})
    return rows


def overshoot(rt, model: str, rounds: int) -> list[dict]:
    from ..runtime import ConfidenceConfig, preset

    kw = dict(model=rt.spec(model, n_parallel=4), max_tokens=16, confidence=ConfidenceConfig(enabled=False))
    rows = []
    for budget in BUDGETS:
        alone = [rt.generate(f"{PROMPT} ({i})", reasoning_budget=budget, sampling=preset("default", seed=i), **kw)
                 for i in range(rounds)]
        batched: list = []

        def go(i, budget=budget, batched=batched):
            batched.append(rt.generate(f"{PROMPT} [{i}]", reasoning_budget=budget, sampling=preset("default", seed=i),
                                       **kw))

        ts = [threading.Thread(target=go, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        over = [r.n_reasoning_tokens - budget for r in alone + batched]
        rows.append({"budget": budget, "requests": len(over), "max_overshoot": max(over), "min_overshoot": min(over),
                     "closed_by_budget": sum(r.reasoning_closed_by == "budget" for r in alone + batched),
                     "answered": sum(bool(r.text.strip()) for r in alone + batched)})
    return rows


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    from ..runtime import Runtime, default_model_path

    rt = Runtime()
    speed = grammar_speed(rt, args.tokens, args.rounds)
    print_table("Decode speed with a JSON-schema grammar vs without (embedded model, medians)",
                ["sampling", "free tok/s", "schema tok/s", "ratio", "schema answer tokens"],
                [[r["sampling"], r["free_tps"], r["schema_tps"], r["ratio"], r["schema_tokens"]] for r in speed])
    with tempfile.TemporaryDirectory() as d:
        r1 = str(with_chat_template(default_model_path(), Path(d) / "r1-shaped.gguf", R1_SHAPE))
        over = overshoot(rt, r1, max(2, args.rounds // 2))
        rt.unload()
    print_table("Reasoning budget: tokens past the budget before the block closed (alone and 4 batched)",
                ["budget", "requests", "max overshoot", "min overshoot", "closed by budget", "answered"],
                [[r["budget"], r["requests"], r["max_overshoot"], r["min_overshoot"], r["closed_by_budget"],
                  r["answered"]] for r in over])
    write_results("reasoning", {"tokens": args.tokens, "rounds": args.rounds, "grammar": speed, "budget": over})

    def draw(ax):
        xs = range(len(speed))
        ax.bar([x - 0.2 for x in xs], [r["free_tps"] for r in speed], 0.4, label="unconstrained")
        ax.bar([x + 0.2 for x in xs], [r["schema_tps"] for r in speed], 0.4, label="JSON schema")
        for x, r in zip(xs, speed):
            ax.text(x + 0.2, r["schema_tps"], f"{r['ratio']:.2f}x", ha="center", va="bottom")
        ax.set_xticks(list(xs), [r["sampling"] for r in speed])
        ax.set_ylabel("decode tokens/s")
        ax.set_title("Embedded model: grammar vs free decode; budget overshoot "
                     f"max {max(r['max_overshoot'] for r in over)} tokens")
        ax.legend()

    plot("reasoning", draw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
