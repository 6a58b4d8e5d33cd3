"""Speculative decoding on the real embedded model (slow tier): the same tokens with and without it."""
from __future__ import annotations

import inspect
import textwrap

import pytest

from comfyui_a3b.runtime import Runtime, preset
from comfyui_a3b.runtime.generation import ConfidenceConfig

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("draft_cost_at_prior")]   # drafts are the point


def _rewrite_prompt() -> str:
    """A function to copy with one name changed: most of the answer is in the prompt."""
    import json.decoder as source   # read as text only

    src = textwrap.dedent(inspect.getsource(source.JSONDecoder.raw_decode))
    head = src.split("\n")[0].replace("idx", "start")
    return f"Original code:\n```python\n{src}```\n\nThe same code with `idx` renamed to `start`:\n```python\n{head}\n"


@pytest.fixture(scope="module")
def rt():
    r = Runtime()
    yield r
    r.unload()


# Seeded sampling draws the same number for each token with or without drafts, but llama.cpp's CPU
# kernels for a batch of several tokens sum in another order than for one token, so the logits differ
# in the last bits and a draw that falls at a boundary can differ (seen once in four runs at temperature
# 0.3 over 160 tokens). Greedy decoding does not meet such boundaries in practice; the sampled rule is
# tested exactly on the fake engine and statistically in tests/test_speculative.py.
@pytest.mark.parametrize("sampling", [preset("greedy")], ids=["greedy"])
def test_ngram_speculation_gives_the_tokens_decoding_alone_gives(rt, sampling):
    prompt = _rewrite_prompt()
    out = {}
    for mode in ("off", "ngram"):
        spec = rt.spec(None, speculative=mode, n_parallel=2)
        out[mode] = rt.submit(prompt, model=spec, chat=False, sampling=sampling, max_tokens=160,
                              confidence=ConfidenceConfig(threshold=2.0, min_run=3)).result()
    a, b = out["off"], out["ngram"]
    assert b.tokens == a.tokens and b.text == a.text
    assert [s.as_dict() for s in a.spans] == [s.as_dict() for s in b.spans]
    # the same seed draws the same tokens: one draw per generated token, drafts or not
    assert b.n_drafted_tokens > 20 and b.n_accepted_tokens > b.n_drafted_tokens / 3
    assert a.n_drafted_tokens == 0


def test_the_embedded_model_as_its_own_draft_has_every_draft_accepted(rt):
    from comfyui_a3b.runtime.models.locate import default_model_path

    path = str(default_model_path())
    prompt = "Write a short story about a lighthouse keeper."
    plain = rt.submit(prompt, model=rt.spec(None, speculative="off"), sampling=preset("greedy"),
                      max_tokens=80).result()
    r = rt.submit(prompt, model=rt.spec(None, speculative=f"draft:{path}"), sampling=preset("greedy"),
                  max_tokens=80).result()
    assert r.tokens == plain.tokens
    assert r.n_drafted_tokens > 30 and r.n_accepted_tokens == r.n_drafted_tokens
