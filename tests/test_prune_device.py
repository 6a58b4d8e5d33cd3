"""`--device` selection for the torch parts of pruning, with a fake "no CUDA" and a fake GPU."""
from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch", reason="the prune extra (torch) is not installed")

from comfyui_a3b.prune.config import PruneConfig  # noqa: E402
from comfyui_a3b.prune.device import resolve_device  # noqa: E402
from comfyui_a3b.prune.errors import InvalidRequest  # noqa: E402


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")


def test_cpu_is_always_the_cpu(fake_gpu):
    assert resolve_device("cpu") == "cpu"


def test_cuda_without_a_gpu_is_a_clear_error(no_cuda):
    with pytest.raises(InvalidRequest, match="--device cuda asks for a GPU.*--device cpu"):
        resolve_device("cuda")


def test_auto_falls_back_to_the_cpu_and_says_so(no_cuda, caplog):
    with caplog.at_level(logging.INFO, logger="comfyui_a3b.prune"):
        assert resolve_device("auto") == "cpu"
    assert "no CUDA device" in caplog.text


def test_auto_takes_the_gpu_and_names_it(fake_gpu, caplog):
    with caplog.at_level(logging.INFO, logger="comfyui_a3b.prune"):
        assert resolve_device("auto") == "cuda"
        assert resolve_device("cuda") == "cuda"
    assert "Fake GPU" in caplog.text


def test_unknown_device_is_refused():
    with pytest.raises(InvalidRequest, match="--device"):
        resolve_device("tpu")
    with pytest.raises(InvalidRequest, match="device"):
        PruneConfig(device="tpu").validate()


def test_where_the_work_runs_does_not_change_the_variant_key():
    base = PruneConfig().key()
    assert PruneConfig(device="cuda", n_gpu_layers=-1, gram_budget_mb=64, threads=3).key() == base
    assert PruneConfig(calibration="auto", recover_corpus="calib").key() == base
    assert PruneConfig(calibration="llama").key() != base
    assert PruneConfig(recover_corpus="wide").key() != base


@pytest.mark.parametrize("bad", [dict(n_gpu_layers=-2), dict(calibration="onnx"), dict(recover_corpus="web"),
                                 dict(gram_budget_mb=0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(InvalidRequest):
        PruneConfig(**bad).validate()
