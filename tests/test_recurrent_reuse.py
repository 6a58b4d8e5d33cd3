"""A model with recurrent layers (qwen35's Gated DeltaNet beside attention) served to requests one
after another on the same slots, as an editor or a workflow sends them (slow tier: a tiny qwen35
GGUF, real llama.cpp, in a child process so a crash fails the test instead of ending the suite).

A recurrent layer keeps one state per sequence, not a cache per position: a slot whose cached
tokens go on past the prefix a new request shares with them cannot be cut back there. Every
request must still decode, and decode what it decodes on a fresh runtime."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tinygguf import write_tiny_gguf

pytestmark = pytest.mark.slow

CHILD = r"""
import json, sys
from comfyui_a3b.runtime import Runtime, preset
path, mode = sys.argv[1], sys.argv[2]
# shared prefixes shorter than what the slots hold, the same prompt twice, and a continuation
prompts = ["the a def return x", "the a def x x", "return the a", "the a def return x",
           "return the a def", "x x the"]
def run(rt, spec, p):
    r = rt.generate(p, model=spec, chat=False, sampling=preset("greedy"), max_tokens=12)
    return {"tokens": list(r.tokens), "finish": r.finish_reason, "cached": r.n_cached_prompt_tokens}
rt = Runtime()
spec = rt.spec(path, speculative=mode, n_parallel=2, n_ctx=256, draft_max=4)
seq = [run(rt, spec, p) for p in prompts]
# a continuation: the next prompt holds everything the slot holds, and more
first = rt.generate(prompt_tokens=[262, 265, 268, 270, 262], model=spec, chat=False, sampling=preset("greedy"),
                    max_tokens=6)
nxt = rt.generate(prompt_tokens=[262, 265, 268, 270, 262] + list(first.tokens) + [265, 268], model=spec, chat=False,
                  sampling=preset("greedy"), max_tokens=6)
cont = {"cached": nxt.n_cached_prompt_tokens, "finish": nxt.finish_reason, "held": 5 + len(first.tokens)}
rt.unload()
fresh = []
for p in prompts:
    rt = Runtime()
    fresh.append(run(rt, rt.spec(path, speculative=mode, n_parallel=2, n_ctx=256, draft_max=4), p))
    rt.unload()
print("RESULT " + json.dumps({"seq": seq, "fresh": fresh, "cont": cont}))
"""


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("recurrent") / "q35.gguf", "qwen35", n_layer=4)


@pytest.mark.parametrize("mode", ["off", "auto", "ngram"])
def test_requests_one_after_another_on_a_recurrent_model_decode_as_on_a_fresh_runtime(qwen35, mode):
    p = subprocess.run([sys.executable, "-c", CHILD, str(qwen35), mode], capture_output=True, text=True,
                       timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child exited {p.returncode}: {p.stderr[-3000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    for i, (a, b) in enumerate(zip(out["seq"], out["fresh"])):
        assert a["finish"] == b["finish"] == "length", (i, a, b)
        assert a["tokens"] == b["tokens"], i
    # a prompt that continues what a slot holds still reuses it
    assert out["cont"]["finish"] == "length" and out["cont"]["cached"] >= out["cont"]["held"] - 1
