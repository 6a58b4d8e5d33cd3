"""The backend_sampling load option on every surface, over the fake engine: A3B Loader's widget and
the handle it makes, the language server's setting and the spec it loads, the `--backend-sampling`
flag of generate, embed and serve, and `a3b generate`'s summary line saying which sampler drew."""
from __future__ import annotations

import pytest

from comfyui_a3b.runtime import options as opt

BACKEND = "fake://surfaces?backend_sampling=1"


def test_loader_has_the_widget_and_its_value_reaches_the_handle(fake_engine):
    from comfyui_a3b.nodes import defs
    from comfyui_a3b.nodes.v1 import NODE_CLASS_MAPPINGS

    names = {i.name: i for i in defs.LOADER.inputs}
    assert names["backend_sampling"].option is opt.BACKEND_SAMPLING
    assert defs.LOADER.inputs[-1].name == "backend_sampling"   # new widgets last: saved workflows keep their order
    run = NODE_CLASS_MAPPINGS["A3BLoader"]().run
    for mode in ("off", "auto"):
        args = {**defs.LOADER.defaults(), "model": BACKEND, "backend_sampling": mode}
        assert run(unique_id="1", **args)["result"][0].backend_sampling == mode


def test_language_server_setting_is_a_load_option(fake_engine):
    from comfyui_a3b.lsp_server.config import Settings, apply
    from comfyui_a3b.lsp_server.session import Engine

    s, errors = apply(Settings(), {"backendSampling": "off"})
    assert s.backend_sampling == "off" and not errors
    bad, errors = apply(s, {"backendSampling": "gpu"})
    assert bad.backend_sampling == "off" and errors and "backendSampling" in errors[0]
    engine = Engine(default_model=BACKEND)
    try:
        assert engine.spec_for(s).backend_sampling == "off"
        assert engine.spec_for(Settings()).backend_sampling == opt.BACKEND_SAMPLING.default
    finally:
        engine.close()


@pytest.mark.parametrize("command", ["generate", "embed", "serve"])
def test_every_model_command_takes_the_flag(fake_engine, command):
    from comfyui_a3b import cli
    from comfyui_a3b.runtime import get_runtime

    args = cli.build_parser().parse_args([command, "--model", BACKEND, "--backend-sampling", "off", "x"]
                                         if command != "serve" else
                                         [command, "--model", BACKEND, "--backend-sampling", "off"])
    assert cli._spec(get_runtime(), args).backend_sampling == "off"


def test_generate_summary_names_the_sampler_and_refuses_a_bad_mode(fake_engine, capsys):
    from comfyui_a3b import cliwords
    from comfyui_a3b.cli import main
    from comfyui_a3b.runtime import ConfidenceConfig, get_runtime, preset

    assert main(["generate", "--model", BACKEND, "--raw", "--max-tokens", "8", "--temperature", "0",
                 "--backend-sampling", "off", "Hi"]) == 0
    assert "cpu sampler" in capsys.readouterr().err
    # generate asks for confidence spans, which the CPU chain gives; with backend_sampling on, a request
    # without them draws in the graph
    on = get_runtime().spec(BACKEND, backend_sampling="on")
    res = get_runtime().generate("Hi", model=on, chat=False, max_tokens=8, sampling=preset("greedy"),
                                 confidence=ConfidenceConfig(enabled=False))
    assert res.sampler == "backend" and "backend sampler" in cliwords.summary(res, 0.1)
    with pytest.raises(SystemExit) as bad:
        main(["generate", "--model", BACKEND, "--backend-sampling", "gpu", "Hi"])
    assert bad.value.code == 2
    assert "--backend-sampling" in capsys.readouterr().err
