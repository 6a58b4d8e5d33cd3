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


def test_recovery_left_at_its_defaults_takes_the_gpu_setting_on_a_gpu(fake_gpu):
    from comfyui_a3b import cli
    from comfyui_a3b.prune import cli as prune_cli
    from comfyui_a3b.prune.config import GPU_RECOVERY, with_device_defaults

    parse = cli.build_parser().parse_args
    cfg = prune_cli.config_from_args(parse(["prune", "m.gguf"]))
    assert {k: getattr(cfg, k) for k in GPU_RECOVERY} == GPU_RECOVERY
    # what the user says stays; only the unset settings change
    cfg = prune_cli.config_from_args(parse(["prune", "m.gguf", "--recover-steps", "50", "--recover-batch", "4"]))
    assert (cfg.recover_steps, cfg.recover_batch, cfg.recover_seq_len, cfg.recover_corpus) == (50, 4, 512, "wide")
    # recovery on the CPU, none at all, or nothing pruned: the CPU defaults
    d = PruneConfig()
    for argv in (["--device", "cpu"], ["--recover-steps", "0"], ["--keep", "1"]):
        cfg = prune_cli.config_from_args(parse(["prune", "m.gguf", *argv]))
        assert (cfg.recover_batch, cfg.recover_seq_len, cfg.recover_corpus) == \
            (d.recover_batch, d.recover_seq_len, d.recover_corpus), argv
    # cached_variant and the A3BLoader pass None for unset settings
    assert with_device_defaults({"keep": 0.8, "recover_steps": None})["recover_steps"] == GPU_RECOVERY["recover_steps"]
    assert with_device_defaults({"keep": 1.0, "recover_steps": None}) == {"keep": 1.0, "recover_steps": None}
    assert with_device_defaults({"keep": 1.0, "heads_keep": 0.5})["recover_batch"] == GPU_RECOVERY["recover_batch"]


def test_recovery_defaults_stay_the_cpus_without_a_gpu(no_cuda):
    from comfyui_a3b import cli
    from comfyui_a3b.prune import cli as prune_cli

    cfg = prune_cli.config_from_args(cli.build_parser().parse_args(["prune", "m.gguf"]))
    d = PruneConfig()
    assert (cfg.recover_steps, cfg.recover_batch, cfg.recover_seq_len, cfg.recover_corpus) == \
        (d.recover_steps, d.recover_batch, d.recover_seq_len, d.recover_corpus)
    with pytest.raises(InvalidRequest, match="--device cuda asks for a GPU"):
        prune_cli.config_from_args(cli.build_parser().parse_args(["prune", "m.gguf", "--device", "cuda"]))
