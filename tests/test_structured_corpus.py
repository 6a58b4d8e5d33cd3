"""Every answer to a corpus of real JSON schemas validates (slow tier, the real embedded model).

The schemas (tests/data/schemas/*.json, each with its source) come from OpenAI's Structured Outputs
guide and llama.cpp's JSON-schema converter tests, plus the storyboard example workflow's. Each is
answered at temperature 0.7 with several seeds, four requests at a time, and every answer must be
text that json.loads accepts and that validates against its schema (jsonschema), including the
bounds (minimum/maximum, lengths, patterns, formats) that llama-cpp-python's converter dropped.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from comfyui_a3b.runtime import Runtime, SamplingParams

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SEEDS = (1, 2, 3)


def corpus() -> list[tuple[str, str, dict, int]]:
    out = []
    for path in sorted((HERE / "data" / "schemas").glob("*.json")):
        d = json.loads(path.read_text())
        assert d["source"] and d["prompt"]
        out.append((path.stem, d["prompt"], d["schema"], 128))
    wf = json.loads((HERE.parent / "examples" / "api" / "storyboard_json.api.json").read_text())
    node = wf["3"]["inputs"]
    out.append(("storyboard example", node["prompt"] + "\n\n" + wf["2"]["inputs"]["value"],
                json.loads(node["json_schema"]), node["max_new_tokens"]))
    return out


def test_every_answer_to_the_schema_corpus_validates():
    import jsonschema

    rt = Runtime()
    spec = rt.spec(n_ctx=2048, n_parallel=4)
    items = [(name, prompt, schema, max_tokens, seed) for name, prompt, schema, max_tokens in corpus()
             for seed in SEEDS]
    answers: dict[tuple[str, int], object] = {}
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not items:
                    return
                name, prompt, schema, max_tokens, seed = items.pop()
            res = rt.generate(prompt, model=spec, json_schema=schema, max_tokens=max_tokens,
                              sampling=SamplingParams(temperature=0.7, seed=seed))
            with lock:
                answers[(name, seed)] = (schema, res)

    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    finally:
        rt.unload()
    bad = []
    for (name, seed), (schema, res) in sorted(answers.items()):
        try:
            jsonschema.validate(json.loads(res.text), schema, format_checker=jsonschema.FormatChecker())
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append(f"{name} seed {seed} ({res.finish_reason}): {str(e).splitlines()[0]}: {res.text!r}")
    assert len(answers) == len(corpus()) * len(SEEDS)
    assert not bad, "\n".join(bad)
