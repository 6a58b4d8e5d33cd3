"""The runtime's speed at another git revision against the working tree's, measured in one run.

    python -m comfyui_a3b.bench.bench_revisions --against REV     # about 4 minutes on 2 cores

bench_runtime compares the runtime with llama-cpp-python's own `Llama` on the same file; where that
baseline cannot run (its CPU weight repacking crashes on some processors), or to check that a
refactoring changed nothing, this compares the code of two revisions instead. REV is unpacked with
`git archive` into a temporary folder and imported from there in its own processes; the two revisions
alternate round by round, so a change in the machine's load hits both alike, and each figure is
reported as the ratio new / old of the medians. Measured on the embedded model with greedy decoding:
decode tokens/s of one request, aggregate tokens/s of 4 concurrent requests (64 tokens each), and the
time to first token of a ~300-token plain prompt. The code measured uses only calls both revisions
have (`get_runtime`, `generate`, `spec`, `preset`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from pathlib import Path

from .common import arguments, median, name_option, plot, print_table, write_results

REPO = Path(__file__).resolve().parent.parent

MEASURE = textwrap.dedent("""
    import json, sys, threading, time
    from comfyui_a3b.runtime import get_runtime, preset
    tokens = int(sys.argv[1])
    prompt = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."
    rt = get_runtime()
    spec = rt.spec(None, n_parallel=4)
    rt.generate("warm up", model=spec, max_tokens=8, sampling=preset("greedy"))
    one = rt.generate(prompt, model=spec, max_tokens=tokens, sampling=preset("greedy")).tokens_per_second
    counts = []
    def run(i):
        counts.append(rt.generate(f"{prompt} Variation {i}.", model=spec, max_tokens=64,
                                  sampling=preset("greedy")).n_tokens)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    four = sum(counts) / (time.perf_counter() - t0)
    body = "\\n".join(f"def helper_{i}(x):\\n    return x * {i} + {i * 7} - len(str(x))" for i in range(20))
    ttft = rt.generate(f"# variant {time.time()}\\n{body}\\n\\ndef main():\\n", model=spec, chat=False,
                       max_tokens=1, sampling=preset("greedy")).time_to_first_token
    print(json.dumps({"decode_tps": one, "aggregate_tps_4": four, "ttft_300_s": ttft}))
""")

FIGURES = (("decode_tps", "decode tok/s, 1 request", True), ("aggregate_tps_4", "aggregate tok/s, 4 requests", True),
           ("ttft_300_s", "first token of a 300-token prompt, s", False))


def unpack(rev: str, into: Path) -> Path:
    """The package as it was at `rev`, importable as comfyui_a3b from the returned folder."""
    pkg = into / "comfyui_a3b"
    pkg.mkdir(parents=True)
    archive = into / "rev.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(REPO), "archive", rev], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(pkg, filter="data")
    archive.unlink()
    return into


def measure(pythonpath: Path, tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(tokens)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--against", required=True, help="the git revision to compare the working tree with")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (each: one process per revision)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded by the single request")
    name_option(ap, "revisions")
    args = ap.parse_args(argv)
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.against], capture_output=True,
                         text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old_path = unpack(rev, Path(tmp) / "old")
        new_path = Path(tmp) / "new"
        new_path.mkdir()
        (new_path / "comfyui_a3b").symlink_to(REPO)
        rounds = []
        for r in range(args.rounds):
            pair = {"old": measure(old_path, args.tokens), "new": measure(new_path, args.tokens)}
            print(f"round {r + 1}/{args.rounds}: " + json.dumps(pair), flush=True)
            rounds.append(pair)
    summary = {}
    for key, _label, _higher in FIGURES:
        old, new = median([p["old"][key] for p in rounds]), median([p["new"][key] for p in rounds])
        summary[key] = {"old": old, "new": new, "ratio_new_over_old": new / old}
    print_table(f"Runtime at {rev} (old) vs the working tree at {head} (new), median of {args.rounds} rounds",
                ["figure", "old", "new", "new / old"],
                [[label, summary[k]["old"], summary[k]["new"], summary[k]["ratio_new_over_old"]]
                 for k, label, _h in FIGURES])
    write_results(args.name, {"against": rev, "head": head, "summary": summary, "rounds": rounds})

    def draw(ax):
        labels = [label for _k, label, _h in FIGURES]
        ax.barh(labels, [summary[k]["ratio_new_over_old"] for k, _l, _h in FIGURES], color="#2a7")
        ax.axvline(1.0, color="#888", linestyle="--")
        ax.set_xlabel(f"new / old ({head} vs {rev}); time: lower is better, tok/s: higher")

    plot(args.name, draw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
