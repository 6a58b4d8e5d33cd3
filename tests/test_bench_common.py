"""The benchmarks' harness (bench/common.py, bench/models.py): command lines, results written and
shown again, random models written once (fast tier: nothing here runs llama.cpp)."""
from __future__ import annotations

import json

import pytest

from comfyui_a3b.bench import common, models

DOC = """A benchmark of something.

    python -m comfyui_a3b.bench.bench_x
"""


@pytest.fixture
def results(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    return tmp_path


def _bench(measured: list):
    ap = common.arguments(DOC)
    common.model_option(ap, positional=True)
    ap.add_argument("--steps", type=int, default=3)
    common.results_options(ap, "bench_x")
    shown: list[dict] = []

    def measure(args) -> dict:
        measured.append(args)
        return {"model": args.model, "steps": args.steps}

    return ap, measure, shown.append, shown


def test_a_run_is_written_with_the_machine_and_shown_under_its_name(results):
    measured: list = []
    ap, measure, report, shown = _bench(measured)
    assert ap.description == "A benchmark of something."
    assert common.execute(ap, ["m.gguf", "--steps", "5", "--name", "run1"], measure, report) == 0
    data = json.loads((results / "run1.json").read_text())
    assert data["benchmark"] == "run1" and data["machine"]["cpus"] and data["steps"] == 5
    assert "name" not in data   # the JSON holds what the benchmark measured, not the report's label
    assert shown == [{"model": "m.gguf", "steps": 5, "name": "run1"}]


def test_report_shows_an_earlier_run_without_measuring(results):
    measured: list = []
    ap, measure, report, shown = _bench(measured)
    common.execute(ap, ["--name", "first"], measure, report)
    shown.clear()
    assert common.execute(ap, ["--report", str(results / "first.json"), "--name", "again"], measure, report) == 0
    assert len(measured) == 1 and shown[0]["steps"] == 3 and shown[0]["name"] == "again"
    assert not (results / "again.json").exists()


def test_the_model_option_and_its_default(tmp_path):
    from comfyui_a3b.runtime import default_model_path

    ap = common.arguments(DOC)
    common.model_option(ap, default="", help="the GGUF")
    assert ap.parse_args([]).model == "" and ap.parse_args(["--model", "a.gguf"]).model == "a.gguf"
    assert common.model_path("") == default_model_path()
    assert common.model_path(tmp_path / "a.gguf") == tmp_path / "a.gguf"
    assert common.command("bench_x", ["--steps", "2"]) == "python -m comfyui_a3b.bench.bench_x --steps 2"
    assert common.ratio(3.0, 2.0) == 1.5 and common.ratio(3.0, 0.0) != common.ratio(3.0, 0.0)   # nan


def test_a_random_model_is_written_once_and_a_given_one_never(tmp_path):
    import gguf

    path, took = models.random_model(None, tmp_path / "r.gguf", "tiny")
    assert took is not None and path == tmp_path / "r.gguf"
    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "blk.1.ffn_down.weight", "blk.0.attn_q_norm.weight"} <= names
    assert models.random_model(None, path, "tiny") == (path, None)
    assert models.random_model(str(tmp_path / "given.gguf"), path, "tiny") == (tmp_path / "given.gguf", None)
    assert not (tmp_path / "given.gguf").exists()
    again = models.write_model(tmp_path / "again.gguf", models.SHAPES["tiny"])
    assert again.read_bytes() == path.read_bytes()   # seeded: the same file every time
