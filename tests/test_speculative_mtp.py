"""Speculative decoding with a model's own multi-token-prediction layers (slow tier): tiny qwen35 GGUFs
written with a nextn block, real llama.cpp, nothing mocked.

llama.cpp's MTP context is young code, so every run happens in a child process: a crash there fails
the test instead of ending the suite.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from comfyui_a3b.runtime import Runtime
from comfyui_a3b.runtime.errors import InvalidRequest
from tinygguf import write_tiny_gguf

pytestmark = pytest.mark.slow

#: the child: load the model once per mode, generate greedily, print what the results say
CHILD = r"""
import json, sys
from comfyui_a3b.runtime import Runtime, preset
path, n_parallel, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = ["the a def return", "x x the a", "return the", "def x"][:n]
rt = Runtime()
out = {}
for mode in ("off", "mtp"):
    spec = rt.spec(path, speculative=mode, n_parallel=n_parallel, n_ctx=256, draft_max=4)
    streams = [rt.submit(p, model=spec, chat=False, sampling=preset("greedy"), max_tokens=48) for p in prompts]
    rs = [s.result(timeout=120) for s in streams]
    out[mode] = [{"tokens": list(r.tokens), "drafted": r.n_drafted_tokens, "accepted": r.n_accepted_tokens,
                  "finish": r.finish_reason} for r in rs]
    out[mode + "_stats"] = {k: v for m in rt.status()["models"] if m["spec"]["speculative"] == mode
                            for k, v in m.get("stats", {}).items() if "draft" in k or "accept" in k}
    rt.unload(spec)
print("RESULT " + json.dumps(out))
"""


def _run(path, n_parallel: int = 1, n: int = 1) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, str(path), str(n_parallel), str(n)], capture_output=True,
                       text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child exited {p.returncode}: {p.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _few_winners(name: str, values: np.ndarray) -> np.ndarray:
    """An output head where four tokens can win: the target and the MTP head (which shares it) then
    agree often, but not always."""
    if name == "output.weight":
        keep = np.zeros_like(values)
        keep[[262, 265, 268, 270]] = values[[262, 265, 268, 270]] * 20
        return keep
    return values


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    return {"random": write_tiny_gguf(d / "mtp.gguf", "qwen35", n_layer=4, mtp_layers=1),
            "agree": write_tiny_gguf(d / "agree.gguf", "qwen35", n_layer=4, mtp_layers=1, seed=3,
                                     tensor_hook=_few_winners),
            "plain": write_tiny_gguf(d / "plain.gguf", "qwen35", n_layer=4)}


def _check_identity(out: dict) -> tuple[int, int]:
    drafted = accepted = 0
    for off, mtp in zip(out["off"], out["mtp"]):
        assert mtp["tokens"] == off["tokens"] and mtp["finish"] == off["finish"]
        assert off["drafted"] == 0
        drafted += mtp["drafted"]
        accepted += mtp["accepted"]
    return drafted, accepted


def test_mtp_drafts_are_verified_and_greedy_text_is_unchanged(models):
    """Random weights: the MTP head rarely agrees with the trunk, so most drafts are rejected and
    trimmed (from the target's cache, its recurrent layers included, and from the MTP cache): the
    text must still be the text decoding alone gives."""
    out = _run(models["random"])
    drafted, accepted = _check_identity(out)
    # the K policy pauses speculation for a request whose drafts are rejected: a few drafts only
    assert drafted >= 3 and 0 <= accepted < drafted
    assert out["mtp_stats"].get("drafted_tokens", 0) == drafted


def test_mtp_drafts_are_accepted_where_the_head_agrees(models):
    """A head that agrees often: drafts are accepted and rejected, side by side for several
    requests in one batch, and every text is the one decoding alone gives. (Two requests for two
    slots: a slot reused with a shorter common prefix would trim a recurrent layer past its snapshots.)"""
    out = _run(models["agree"], n_parallel=2, n=2)
    drafted, accepted = _check_identity(out)
    assert drafted > 20 and 0 < accepted < drafted
    assert out["mtp_stats"]["accepted_tokens"] == accepted


def test_mtp_on_a_model_without_mtp_layers_is_a_message(models):
    rt = Runtime()
    try:
        with pytest.raises(InvalidRequest, match="has no multi-token-prediction layers"):
            rt.load(rt.spec(str(models["plain"]), speculative="mtp"))
    finally:
        rt.unload()
