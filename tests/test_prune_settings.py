"""The pruning settings' declarations (prune/settings.py): PruneConfig's defaults and checks, `a3b
prune`'s flags, cache keys that do not move, and the one rule for recovery with expert pruning."""
from __future__ import annotations

import argparse
from dataclasses import fields

import pytest
from tinygguf import write_tiny_gguf

from comfyui_a3b.nodes import core, defs
from comfyui_a3b.prune import cli as prune_cli
from comfyui_a3b.prune import settings
from comfyui_a3b.prune.cache import variant_path
from comfyui_a3b.prune.config import PruneConfig
from comfyui_a3b.runtime.errors import InvalidRequest

#: keys and cached file names of a few configs, computed by the code before the settings were declared
#: (source: b"GGUF" + bytes(range(256))): a variant cached then is found now
BEFORE = [
    ({}, "m.a3b-a3b-keep0.63-r160-f4f8a77f6da5-d14bb8ea1c6c2d88.gguf"),
    ({"keep": 0.5}, "m.a3b-a3b-keep0.5-r160-f4f8a77f6da5-ee3af6e0b58a7290.gguf"),
    ({"keep": 0.5, "method": "wanda", "recover_steps": 0}, "m.a3b-wanda-keep0.5-r0-f4f8a77f6da5-49b843f7666eca50.gguf"),
    ({"heads_keep": 0.67}, "m.a3b-a3b-keep0.63-r160-f4f8a77f6da5-835daaab83d4e008.gguf"),
    ({"experts_keep": 0.5, "keep": 1.0, "recover_steps": 0},
     "m.a3b-a3b-keep1-ereap0.5-r0-f4f8a77f6da5-be9510a7c058fb75.gguf"),
    ({"calibration": "llama", "recover_steps": 0}, "m.a3b-a3b-keep0.63-r0-f4f8a77f6da5-e10d689302d780fc.gguf"),
    ({"recover_corpus": "wide", "recover_batch": 32, "recover_seq_len": 512, "recover_steps": 2000},
     "m.a3b-a3b-keep0.63-r2000-f4f8a77f6da5-952c572b14b86f36.gguf"),
    ({"recover_code_share": 0.3, "lr": 1e-4, "seed": 3, "qat": False, "align": 32, "gate_windows": 4,
      "gate_sparsity": 0.3}, "m.a3b-a3b-keep0.63-r160-f4f8a77f6da5-9de4c7fad3f863b5.gguf"),
    ({"device": "cuda", "threads": 2, "n_gpu_layers": -1, "gram_budget_mb": 64},
     "m.a3b-a3b-keep0.63-r160-f4f8a77f6da5-d14bb8ea1c6c2d88.gguf"),
    ({"expert_method": "frequency", "experts_keep": 0.25, "keep": 1.0, "recover_steps": 0},
     "m.a3b-a3b-keep1-efrequency0.25-r0-f4f8a77f6da5-5dfd95ff12773923.gguf"),
]


@pytest.mark.parametrize("given,name", BEFORE)
def test_cache_keys_and_variant_names_are_those_made_before(tmp_path, given, name):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + bytes(range(256)))
    cfg = PruneConfig(**given)
    cfg.validate()
    assert variant_path(src, cfg, tmp_path).name == name
    assert name.endswith(f"-{cfg.key()}.gguf")


def test_every_field_is_a_declaration_and_takes_its_default():
    assert [f.name for f in fields(PruneConfig)] and {f.name for f in fields(PruneConfig)} == set(settings.BY_NAME)
    d = PruneConfig()
    for f in fields(PruneConfig):
        assert getattr(d, f.name) == settings.BY_NAME[f.name].default, f.name


@pytest.mark.parametrize("option", [o for o in settings.OPTIONS if o.min is not None or o.max is not None])
def test_validate_refuses_past_each_declared_bound(option):
    bad = []
    if option.min is not None:
        bad.append(option.min if option.low_open else option.min - (1 if option.type is int else 0.01))
    if option.max is not None:
        bad.append(option.max if option.high_open else option.max + (1 if option.type is int else 0.01))
    for value in bad:
        with pytest.raises(InvalidRequest):
            PruneConfig(**{option.name: value}).validate()
    inside = option.default if option.default is not None else option.min
    PruneConfig(**{option.name: inside}).validate()


def test_choices_are_checked_from_the_declarations():
    for option in settings.OPTIONS:
        if option.choices:
            for value in option.choices:
                PruneConfig(**{option.name: value}).validate()
            with pytest.raises(InvalidRequest, match="'bogus'"):
                PruneConfig(**{option.name: "bogus"}).validate()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    prune_cli.add_arguments(p)
    return p


def test_every_flag_is_built_from_its_declaration():
    actions = {a.dest: a for a in _parser()._actions}
    for option in settings.OPTIONS:
        if option.name in prune_cli.NOT_FLAGS:
            assert option.name not in actions
            continue
        action = actions[option.name]
        assert action.option is option, option.name
        assert action.help.startswith(option.help[0].lower() + option.help[1:].rstrip(".")) \
            or option.name == "qat", option.name
        if option.choices:
            assert tuple(action.choices) == option.choices, option.name
        elif option.type in (int, float) and option.name not in ("calib_files", "calib_dirs"):
            assert action.type is option.type, option.name
        if action.default not in (None, []):
            assert action.default == option.default, option.name
    flags = {s for a in actions.values() for s in a.option_strings}
    assert {"--calib-file", "--calib-dir", "--no-qat", "--out", "-o", "--force", "--cache-dir", "--quiet",
            "--json"} <= flags


# -- one rule: expert pruning is one-shot -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("rule")
    return {"dense": write_tiny_gguf(d / "dense.gguf", "llama"), "moe": write_tiny_gguf(d / "moe.gguf", "qwen3moe")}


#: (recover_steps given, experts_keep, model) -> steps, or InvalidRequest
RULE = [(None, 1.0, "dense", None), (None, 0.5, "dense", 0), (None, 1.0, "moe", 0), (None, 0.5, "moe", 0),
        (40, 1.0, "dense", 40), (0, 0.5, "moe", 0), (0, 1.0, "moe", 0), (40, 0.5, "moe", InvalidRequest),
        (40, 0.5, "dense", InvalidRequest)]


@pytest.mark.parametrize("steps,experts_keep,model,want", RULE)
def test_the_rule(models, steps, experts_keep, model, want):
    if want is InvalidRequest:
        with pytest.raises(InvalidRequest, match="one-shot. Pass --recover-steps 0"):
            settings.recover_steps_for(steps, experts_keep=experts_keep, source=models[model])
    else:
        assert settings.recover_steps_for(steps, experts_keep=experts_keep, source=models[model]) == want


@pytest.mark.parametrize("steps,experts_keep,model,want", RULE)
def test_the_cli_follows_the_rule(models, steps, experts_keep, model, want, monkeypatch):
    monkeypatch.setattr("comfyui_a3b.prune.config.resolve_device", lambda device: "cpu")
    argv = [str(models[model]), "--keep", "0.5", *(["--recover-steps", str(steps)] if steps is not None else []),
            *(["--experts-keep", str(experts_keep)] if experts_keep < 1.0 else [])]
    args = _parser().parse_args(argv)
    if want is InvalidRequest:
        with pytest.raises(InvalidRequest, match="one-shot. Pass --recover-steps 0"):
            prune_cli.config_from_args(args, models[model])
        return
    cfg = prune_cli.config_from_args(args, models[model])
    assert cfg.recover_steps == (PruneConfig.recover_steps if want is None else want)


@pytest.mark.parametrize("steps,experts_keep,model,want", RULE)
def test_the_node_follows_the_rule(models, steps, experts_keep, model, want, monkeypatch, tmp_path):
    from comfyui_a3b import prune

    seen = []
    monkeypatch.setattr(prune, "cached_variant", lambda path, **kw: seen.append(kw) or tmp_path / f"v{len(seen)}")
    core.VARIANTS.reset()
    widget = -1 if steps is None else steps   # the widget's -1 leaves it unset
    if want is InvalidRequest:
        with pytest.raises(core.NodeError, match="one-shot. Set recover_steps to 0, or to -1"):
            core.pruned_variant(models[model], 0.5, None, widget, 1.0, experts_keep)
        return
    core.pruned_variant(models[model], 0.5, None, widget, 1.0, experts_keep)
    assert seen[0]["recover_steps"] == want   # None: cached_variant takes the default for where recovery runs


def test_the_node_widgets_read_the_declarations():
    inputs = {i.name: i for i in defs.PRUNE.inputs}
    steps = inputs["recover_steps"]
    assert steps.option.name == "recover_steps" and (steps.min, steps.default) == (settings.RECOVER_STEPS.min - 1, -1)
    assert steps.none_value == -1
    method = inputs["prune_method"]
    assert set(method.choices()) == set(settings.METHODS) and method.default == settings.METHOD.default
    assert method.choices()[0] == settings.METHOD.default
    for name, option in (("keep_ratio", settings.KEEP), ("heads_keep", settings.HEADS_KEEP),
                         ("experts_keep", settings.EXPERTS_KEEP)):
        assert inputs[name].option.widget_bounds() == option.widget_bounds(), name
