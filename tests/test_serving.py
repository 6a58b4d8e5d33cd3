"""Serving formats: a cached re-encoded copy, chosen explicitly or by measured prompt speed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from comfyui_a3b.runtime import Runtime, preset
from comfyui_a3b.runtime.errors import InvalidRequest

pytestmark = pytest.mark.slow  # re-encodes the real embedded model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("A3B_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "serving"


def test_reencoded_copy_is_made_once_and_served(cache, tiny_models):
    r = Runtime()
    spec = r.spec(tiny_models["llama"], n_ctx=64, n_parallel=1, serve_as="q8_0")
    m = r.load(spec)
    assert m.info.file_type == "Q8_0" and Path(m.info.path).parent == cache
    copy = Path(m.info.path)
    mtime = copy.stat().st_mtime_ns
    assert r.generate("the", model=spec, chat=False, max_tokens=4, sampling=preset("greedy")).n_tokens == 4
    assert r.status()["models"][0]["served_file"] == str(copy)
    r.unload()
    r.load(spec)
    assert copy.stat().st_mtime_ns == mtime  # cached, not made again
    assert not list(cache.glob("*.tmp*"))    # nothing half-written left
    r.unload()


def test_auto_measures_once_and_records_its_choice(cache, tiny_models):
    r = Runtime()
    m = r.load(tiny_models["qwen2"], n_ctx=64, n_parallel=1, serve_as="auto")
    choice = json.loads(next(cache.glob("*.choice.json")).read_text())
    assert set(choice["prefill_tokens_per_s"]) == {"as-is", "q8_0"}
    assert all(v > 0 for v in choice["prefill_tokens_per_s"].values())
    assert m.info.path == choice["path"]
    r.unload()


def test_unknown_serving_format(tiny_models):
    with pytest.raises(InvalidRequest, match="serve_as"):
        Runtime().spec(tiny_models["llama"], serve_as="q1_magic")
