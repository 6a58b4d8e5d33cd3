"""Bad input: every failure a user can cause is a typed error that says what to do."""
from __future__ import annotations

import hashlib
import logging

import pytest

from comfyui_a3b.runtime import inspect_gguf, preset, verify_sha256
from comfyui_a3b.runtime.errors import (ChecksumMismatch, ContextTooLarge, InvalidRequest, ModelNotFound,
                                        NotGGUF, PathNotAllowed, TruncatedGGUF, UnsupportedArchitecture)
from comfyui_a3b.runtime.llama.weights import probe_architecture
from tinygguf import truncated_copy, write_tiny_gguf


def test_missing_file(rt, tmp_path):
    with pytest.raises(ModelNotFound, match="not found"):
        rt.load(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFound):
        inspect_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf(rt, tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("this is a text file, not a model")
    with pytest.raises(NotGGUF, match="not a GGUF"):
        rt.load(p)


@pytest.mark.parametrize("fraction", [0.01, 0.5, 0.95])
def test_truncated_gguf(rt, tiny_models, tmp_path, fraction):
    p = truncated_copy(tiny_models["llama"], tmp_path / "cut.gguf", fraction)
    with pytest.raises(TruncatedGGUF, match="truncated"):
        rt.load(p)


def test_unknown_architecture_names_it_and_the_llama_cpp_version(rt, tmp_path):
    p = write_tiny_gguf(tmp_path / "future.gguf", "futurearch9")
    info = inspect_gguf(p)
    assert info.architecture == "futurearch9"
    ok, why = probe_architecture(p)
    assert not ok and "futurearch9" in why
    with pytest.raises(UnsupportedArchitecture) as ei:
        rt.load(p)
    msg = str(ei.value)
    assert "futurearch9" in msg and "llama-cpp-python 0.3" in msg


def test_n_ctx_beyond_trained_context_warns_or_refuses(rt, tiny_models, caplog):
    p = tiny_models["llama"]  # trained context 256
    with pytest.raises(ContextTooLarge, match="256"):
        rt.load(p, n_ctx=1024, ctx_policy="refuse")
    with caplog.at_level(logging.WARNING, logger="a3b.store"):
        rt.load(p, n_ctx=1024, n_parallel=1, ctx_policy="warn")
    assert "beyond" in caplog.text
    entry = rt.store.entry(rt.spec(p, n_ctx=1024, n_parallel=1, ctx_policy="warn"))
    assert entry.warnings and "trained context of 256" in entry.warnings[0]


def test_checksum(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"abc" * 1000)
    good = hashlib.sha256(p.read_bytes()).hexdigest()
    assert verify_sha256(p, good) == good
    with pytest.raises(ChecksumMismatch, match="mismatch"):
        verify_sha256(p, "0" * 64)
    with pytest.raises(InvalidRequest, match="64 hex"):
        verify_sha256(p, "xyz")


def test_restricted_names_refuse_paths_outside_model_folders(rt, tmp_path, monkeypatch, tiny_models):
    models = tmp_path / "models"
    models.mkdir()
    (models / "ok.gguf").write_bytes(tiny_models["llama"].read_bytes())
    monkeypatch.setenv("A3B_MODELS", str(models))
    assert rt.spec("ok.gguf", restrict=True).path == str((models / "ok.gguf").resolve())
    for bad in ["/etc/passwd", "../models/../../etc/passwd", str(tiny_models["llama"])]:
        with pytest.raises(PathNotAllowed):
            rt.spec(bad, restrict=True)
    with pytest.raises(ModelNotFound, match="Available: ok.gguf"):
        rt.spec("missing.gguf", restrict=True)


def test_invalid_load_options(rt):
    for opts in ({"n_ctx": 4}, {"n_parallel": 0}, {"flash_attn": "sometimes"}, {"ctx_policy": "maybe"},
                 {"lora_scale": float("nan")}, {"n_ctx": 2048.5}):
        with pytest.raises(InvalidRequest):
            rt.spec(None, **opts)
    loads = rt.store.weight_loads
    with pytest.raises(InvalidRequest, match="kv_cache_type must be one of f16, q8_0"):
        rt.load(None, kv_cache_type="q3_weird")  # refused before any weights load
    assert rt.store.weight_loads == loads


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_architectures_load_generate_and_embed(rt, tiny_models, arch):
    spec = rt.spec(tiny_models[arch], n_ctx=128, n_parallel=2)
    info = inspect_gguf(spec.path)
    assert info.architecture == arch and info.block_count == 2 and info.feed_forward_length == 128
    res = rt.generate("the", model=spec, chat=False, max_tokens=6, sampling=preset("greedy"))
    assert res.n_tokens == 6
    again = rt.generate("the", model=spec, chat=False, max_tokens=6, sampling=preset("greedy"))
    assert again.tokens == res.tokens
    assert rt.embed(["the x"], model=spec).shape == (1, 64)
    rt.unload(spec)
