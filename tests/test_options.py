"""Each option is declared once (runtime/options/) and every surface reads that declaration.

Walks every surface, the runtime's own types, the CLI's flags, the node widgets, the language
server's settings and `a3b serve`'s request fields, and fails where a default or a bound differs
from the declaration, or where a surface takes a setting without one. Fast tier: no model (serve
over the fake engine).
"""
from __future__ import annotations

import argparse
import ast
import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest

from comfyui_a3b import cli, cliwords
from comfyui_a3b.lsp_server import config as lsp
from comfyui_a3b.nodes import core as node_core
from comfyui_a3b.nodes import generation as node_generation
from comfyui_a3b.nodes import embeddings as node_embeddings
from comfyui_a3b.nodes import defs
from comfyui_a3b.prune import config as prune_config
from comfyui_a3b.prune import settings as prune_settings
from comfyui_a3b.runtime import options as opt
from comfyui_a3b.runtime.core import Runtime
from comfyui_a3b.runtime.errors import InvalidRequest
from comfyui_a3b.runtime.generation import PRESETS, ConfidenceConfig, SamplingParams
from comfyui_a3b.runtime.options import LoadSpec, Option, check, cli_help
from comfyui_a3b.runtime.requests import GenerationRequest
from comfyui_a3b.serve.protocol import fields as serve_fields, parse_chat

ROOT = Path(__file__).resolve().parent.parent
NUMERIC = [o for o in opt.OPTIONS.values() if o.type in (int, float) and o.choices is None]
BOUNDS = ("type", "min", "max", "low_open", "high_open", "choices", "words", "step")
PRUNE_RATIOS = (prune_config.KEEP, prune_config.HEADS_KEEP, prune_config.EXPERTS_KEEP)


def edges(option: Option) -> tuple[list, list]:
    """Values at the bounds (taken) and just past them (refused)."""
    inside, outside = [], []
    for bound, is_open, sign in ((option.min, option.low_open, -1), (option.max, option.high_open, 1)):
        if bound is None:
            continue
        if option.type is int:
            inside.append(int(bound))
            outside.append(int(bound) + sign)
        else:
            eps = 1e-6 * max(1.0, abs(bound))
            inside.append(bound - sign * eps if is_open else bound)
            outside.append(bound if is_open else bound + sign * eps)
    return inside, outside


def _bounds(option: Option) -> tuple:
    return tuple(getattr(option, name) for name in BOUNDS)


# -- the runtime's types -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, group", [(LoadSpec, opt.LOAD_OPTIONS), (SamplingParams, opt.SAMPLING_OPTIONS),
                                        (ConfidenceConfig, opt.CONFIDENCE_OPTIONS),
                                        (GenerationRequest, opt.REQUEST_OPTIONS)])
def test_the_runtime_types_take_their_defaults_from_the_declarations(cls, group):
    declared = {f.name: f.default for f in fields(cls) if f.name in group}
    assert set(declared) == set(group), f"{cls.__name__} lacks {set(group) - set(declared)}"
    for name, default in declared.items():
        assert default == group[name].default, f"{cls.__name__}.{name} = {default!r}, declared {group[name].default!r}"


def _validate(option: Option, value) -> None:
    if option.name in opt.LOAD_OPTIONS:
        LoadSpec("model.gguf", **{option.name: value}).validate()
    elif option.name in opt.SAMPLING_OPTIONS:
        SamplingParams(**{option.name: value}).validate()
    elif option.name in opt.CONFIDENCE_OPTIONS:
        GenerationRequest("hi", confidence=ConfidenceConfig(**{option.name: value})).validate()
    elif option.name in opt.REQUEST_OPTIONS:
        GenerationRequest("hi", **{option.name: value}).validate()
    else:
        check(option, value)


@pytest.mark.parametrize("option", NUMERIC, ids=lambda o: o.name)
def test_the_runtime_checks_are_the_declared_bounds(option):
    inside, outside = edges(option)
    assert inside and outside, f"{option.name} has no bounds"
    for value in inside:
        _validate(option, value)
    said = re.escape(f"{option.label or option.name} must be {option.range_text()}")
    for value in outside:
        with pytest.raises(InvalidRequest, match=said):
            _validate(option, value)


def test_the_callers_defaults_are_the_declared_ones():
    assert PRESETS["default"] == SamplingParams()
    params = inspect.signature(Runtime.request).parameters
    assert params["max_tokens"].default == opt.MAX_TOKENS.default == 512
    params = inspect.signature(Runtime.embed).parameters
    assert (params["pooling"].default, params["normalize"].default) == (opt.POOLING.default, opt.NORMALIZE.default)
    assert inspect.signature(node_generation.generate).parameters["max_new_tokens"].default == opt.MAX_TOKENS.default
    assert inspect.signature(node_embeddings.embed).parameters["pooling"].default == opt.POOLING.default
    for option in PRUNE_RATIOS:
        assert getattr(prune_config.PruneConfig, option.name) == option.default


def test_the_seed_wraps_in_one_place():
    assert opt.wrap_seed(2**32 + 5) == 5 == opt.wrap_seed(5)
    assert node_generation.sampling_params(seed=2**64 - 1).seed == 2**32 - 1
    assert serve_fields.sampling_of({"seed": 2**32 + 7}).seed == 7
    with pytest.raises(InvalidRequest, match="seed must be"):
        serve_fields.sampling_of({"seed": "7"})


def test_options_does_not_import_serving():
    """The options (then one module) imported serving.py (now llama/reencode.py) for its formats,
    closing an import cycle through llama/. Every module of the package imports only the standard
    library, environment.py, errors.py and its own modules."""
    from comfyui_a3b.runtime.llama import reencode as serving

    package = ROOT / "runtime" / "options"
    modules = sorted(package.glob("*.py"))
    assert {p.name for p in modules} >= {"__init__.py", "option.py", "load.py", "request.py"}
    imported = set()
    for path in modules:
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, ast.ImportFrom):
                imported.add(("." * n.level) + (n.module or ""))
            elif isinstance(n, ast.Import):
                imported.update(a.name for a in n.names)
    stdlib = {"__future__", "argparse", "collections.abc", "dataclasses", "math", "os", "pathlib", "typing"}
    assert imported <= stdlib | {"..environment", "..errors", ".option", ".load", ".request"}, imported
    assert tuple(serving.SERVE_AS) == opt.SERVE_AS



def test_the_package_holds_every_name_its_modules_declare():
    """Callers import every option from the package: each module's public names are in its __all__."""
    import importlib

    for path in sorted((ROOT / "runtime" / "options").glob("[!_]*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        declared = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        declared |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        module = importlib.import_module(f"comfyui_a3b.runtime.options.{path.stem}")
        public = {name for name in declared if not name.startswith("_")}
        assert public == set(module.__all__), (path.name, public ^ set(module.__all__))
        assert all(getattr(opt, name) is getattr(module, name) for name in public), path.name


#: what every surface says to speculative=draft without a model (parse_speculative, the form of SPECULATIVE)
NO_DRAFT_MODEL = "speculative=draft needs a model: draft:MODEL (a GGUF path or name with the same vocabulary)."


def test_a_declared_form_is_checked_by_check_on_every_surface():
    class Refused(Exception):
        pass

    assert opt.SPECULATIVE.form is opt.parse_speculative and opt.SPECULATIVE.or_none().form is opt.parse_speculative
    for bad in ("draft", "draft:", " draft:  "):
        with pytest.raises(InvalidRequest) as e:
            check(opt.SPECULATIVE, bad)
        assert str(e.value) == NO_DRAFT_MODEL
        with pytest.raises(Refused) as e:   # the error type the caller gives, the form's message
            check(opt.SPECULATIVE, bad, error=Refused)
        assert str(e.value) == NO_DRAFT_MODEL
        for surface in (lambda v: serve_fields.speculative_of({"speculative": v}),
                        lambda v: LoadSpec("m.gguf", speculative=v).validate(),
                        lambda v: GenerationRequest("hi", speculative=v).validate()):
            with pytest.raises(InvalidRequest) as e:
                surface(bad)
            assert str(e.value) == NO_DRAFT_MODEL, bad
        settings, errors = lsp.apply(lsp.Settings(), {"speculative": bad})
        assert settings == lsp.Settings() and errors == [
            f"A3B setting 'speculative' must be text, or null; got {bad!r}. Keeping None."]
    with pytest.raises(InvalidRequest, match="one of off, ngram, draft:MODEL, mtp, auto; got 'ngram:3'"):
        check(opt.SPECULATIVE, "ngram:3")
    # the form sees values of the option's type only: the type's own message first, None where taken
    with pytest.raises(InvalidRequest, match=r"^speculative must be text, got 5$"):
        check(opt.SPECULATIVE, 5)
    assert check(opt.SPECULATIVE.or_none(), None) is None
    assert check(opt.SPECULATIVE, "draft:small.gguf") == "draft:small.gguf"
    assert serve_fields.speculative_of({"speculative": "draft:small.gguf"}) == ("draft:small.gguf", None)

    def even_form(value: int) -> None:
        if value % 2:
            raise InvalidRequest("n must be even")

    # any Option may declare a form: its bounds are checked first, then the form
    even = Option("n", int, 2, "An even count.", min=0, max=10, form=even_form)
    assert check(even, 4) == 4
    with pytest.raises(InvalidRequest, match="^n must be even$"):
        check(even, 3)
    with pytest.raises(InvalidRequest, match=r"^n must be in 0..10, got 11$"):
        check(even, 11)


# -- the command line ------------------------------------------------------------------------------------------
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return " ".join(parser._get_formatter()._expand_help(action).split()) if action.help else ""


#: flags that set a runtime field under another name (cliwords rewrites the runtime's messages with them)
RENAMED = {flag: field for field, flag in cliwords.FIELD_FLAGS.items()}


def test_every_flag_of_a_runtime_option_is_its_declaration():
    seen = set()
    for name, parser in _subparsers().items():
        if name == "prune":   # its own settings (PruneConfig): the next test
            continue
        for action in parser._actions:
            option = getattr(action, "option", None)
            flags = set(action.option_strings)
            names_one = action.dest in opt.OPTIONS or flags & set(RENAMED)
            if option is None:
                assert not names_one, f"a3b {name} {action.option_strings}: add it with options.add_argument"
                continue
            seen.add(option.name)
            where = f"a3b {name} {action.option_strings[0]}"
            assert action.choices == option.choices, where
            if option.choices is None and option.type is not bool:
                # a JSON object is given as the name of a file holding it
                assert action.type is (str if option.type is dict else option.type) or option.words, where
            help_text = _help(parser, action)
            assert help_text.startswith(" ".join(cli_help(option.help).split())), (where, help_text)
            if action.default == option.default:
                if option.default is not None and option.type is not bool:   # a switch is off when left out
                    assert f"(default: {option.default})" in help_text, (where, help_text)
            else:   # left out, a sampling flag keeps the preset's value; the default preset is the declarations
                assert name == "generate" and option.name in cli.SAMPLING_OPTIONS and action.default is None, where
                assert "(default: the preset's value)" in help_text, where
    assert {"n_ctx", "n_threads", "n_gpu_layers", "ctx_policy", "max_tokens", "seed", "threshold", "min_run",
            "pooling", "n_parallel", "thinking", "reasoning_budget", "max_total_tokens", "json_schema",
            "cpu_moe", "n_cpu_moe", "override_tensor", *cli.SAMPLING_OPTIONS} <= seen


def test_generate_passes_the_runtimes_max_tokens_and_says_so(capsys):
    """`a3b generate --help` said 256 and generate passed 256, where the runtime's default is 512."""
    args = cli.build_parser().parse_args(["generate", "hi"])
    assert args.max_tokens == opt.MAX_TOKENS.default
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--help"])
    assert f"most tokens to generate (default: {opt.MAX_TOKENS.default})" in " ".join(capsys.readouterr().out.split())


def test_the_prune_flags_take_prune_configs_defaults_and_bounds():
    parser = _subparsers()["prune"]
    d = prune_config.PruneConfig()
    dests = {f.name for f in fields(d)}
    for action in parser._actions:
        if action.dest in dests and action.default is not None and action.default != []:
            assert action.default == getattr(d, action.dest), action.option_strings
    for option in PRUNE_RATIOS:
        action = next(a for a in parser._actions if a.dest == option.name)
        assert option.range_text() in _help(parser, action), action.option_strings


# -- the ComfyUI nodes --------------------------------------------------------------------------------------
#: widgets that are their node's own and have no declaration elsewhere
NODE_OWN = {("A3BLoader", "model"), ("A3BLoader", "lora"), ("A3BGenerate", "prompt"), ("A3BGenerate", "system"),
            ("A3BGenerate", "stop"), ("A3BGenerate", "confidence_aware"), ("A3BEmbed", "text"),
            ("A3BTopK", "top_k"), ("A3BTopK", "separator"), ("A3BUnload", "unload_all"), ("A3BLoader", "mmproj"),
            ("A3BGenerate", "image_mode")}
#: the loader's pruning widgets: 1 (no pruning) by default, PruneConfig's bounds
NODE_RATIOS = {defs.KEEP_RATIO.name: prune_config.KEEP, defs.HEADS_KEEP.name: prune_config.HEADS_KEEP,
               defs.EXPERTS_KEEP.name: prune_config.EXPERTS_KEEP}
#: the A3B Prune node's other widgets: the pruning declarations (the default first among the methods;
#: recover_steps' -1 leaves it unset, and its widget stops at 10000)
NODE_PRUNE = {"prune_method": prune_settings.METHOD, "recover_steps": prune_settings.RECOVER_STEPS}


def test_every_node_widget_is_its_declaration():
    runtime_options = {id(o) for o in opt.OPTIONS.values()}
    for node in defs.NODES:
        for i in node.inputs:
            where = f"{node.node_id}.{i.name}"
            if not i.is_widget:
                continue
            o = i.option
            if o is None:
                assert (node.node_id, i.name) in NODE_OWN, f"{where}: make it with nodes.schema.widget(option)"
                continue
            if id(o) not in runtime_options and o.name in NODE_RATIOS:
                base = NODE_RATIOS[o.name]
                assert _bounds(o) == _bounds(base), f"{where}: PruneConfig's bounds"
                assert o.default == 1.0, f"{where}: 1.0, no pruning"
            elif id(o) not in runtime_options:
                base = NODE_PRUNE[i.name]
                assert (o.type, o.min, o.low_open, set(o.choices or ())) == \
                    (base.type, base.min, base.low_open, set(base.choices or ())), f"{where}: the pruning declaration"
            lo, hi = o.widget_bounds()
            default = o.default
            if o.words:   # the number below the minimum stands for the word
                lo = o.min - 1
                default = lo if default in o.words else default
            elif i.none_value is not None:   # or for None (reasoning_budget's no limit)
                assert o.nullable and i.none_value == o.min - 1, where
                lo = i.none_value
                default = lo if default is None else default
            elif default is None:   # a text widget starts empty, a number at its minimum
                default = "" if i.type == "STRING" else o.min
            if i.type == "INT" and o.step and not o.words and i.none_value is None and lo % o.step:
                lo = -(-lo // o.step) * o.step   # on the step's grid: the frontend snaps to min + k * step
                default = max(default, lo)
            assert (i.min, i.max, i.step) == (lo, hi, o.step), where
            assert i.default == default, where
            assert i.tooltip.startswith(o.help), where
            assert i.choices() == list(o.choices or ()), where
            for value in (i.min, i.max) if o.type in (int, float) else ():
                if not (o.words and value == lo) and value != i.none_value:
                    check(o, value)   # a widget never offers a value the runtime refuses
    assert defs.AUTO_GPU_LAYERS == opt.N_GPU_LAYERS.min - 1
    assert defs.NO_BUDGET == opt.REASONING_BUDGET.min - 1


def test_the_loader_refuses_ratios_past_prune_configs_bounds(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    for name, base in NODE_RATIOS.items():
        args = {"keep_ratio": 1.0, "heads_keep": 1.0, "experts_keep": 1.0}
        for value in edges(base)[1]:
            with pytest.raises(node_core.NodeError, match=re.escape(f"{name} must be {base.range_text()}")):
                node_core.pruned_variant(model, **{**args, name: value})


# -- the language server's settings --------------------------------------------------------------------------
def test_every_editor_setting_is_its_declaration():
    base = lsp.Settings()
    for key, (field, option) in lsp._KEYS.items():
        assert getattr(base, field) == option.default, key
        if option.name in opt.OPTIONS:   # a runtime option: the runtime's bounds
            assert _bounds(option) == _bounds(opt.OPTIONS[option.name]), key
        if option.type not in (int, float) or option.choices:
            continue
        inside, outside = edges(option)
        assert inside and outside, key
        for value in inside:
            new, errors = lsp.apply(base, {key: value})
            assert not errors and getattr(new, field) == value, (key, value, errors)
        for value in outside:
            new, errors = lsp.apply(base, {key: value})
            assert len(errors) == 1 and option.describe(none="null") in errors[0], (key, value, errors)
            assert getattr(new, field) == getattr(base, field)
    assert lsp._KEYS["nCtx"][1].nullable and lsp.apply(base, {"nCtx": None}) == (base, [])
    assert lsp._KEYS["confidenceThreshold"][1] is opt.THRESHOLD
    assert lsp.MAX_TOKENS.name != opt.MAX_TOKENS.name   # the editor's own completion length, not a second default


def test_editor_settings_that_are_not_numbers():
    base = lsp.Settings()
    for key, good, bad in (("fim", ["auto", "on", "off", True], ["maybe", 1]), ("warm", [True, False], [1, "yes"]),
                           ("model", ["x.gguf", None], [3])):
        for value in good:
            assert lsp.apply(base, {key: value})[1] == [], (key, value)
        for value in bad:
            assert len(lsp.apply(base, {key: value})[1]) == 1, (key, value)


# -- a3b serve ------------------------------------------------------------------------------------------------
#: request fields -> the option they set
SERVE_FIELDS = {"temperature": opt.TEMPERATURE, "top_p": opt.TOP_P, "top_k": opt.TOP_K, "min_p": opt.MIN_P,
                "repeat_penalty": opt.REPEAT_PENALTY, "repetition_penalty": opt.REPEAT_PENALTY}


def test_serve_takes_the_declared_bounds():
    for name, option in SERVE_FIELDS.items():
        for value in edges(option)[0]:
            assert getattr(serve_fields.sampling_of({name: value}), option.name) == value, (name, value)
        for value in edges(option)[1]:
            with pytest.raises(InvalidRequest):
                serve_fields.sampling_of({name: value})
    for name, option in (("max_tokens", opt.MAX_TOKENS), ("n_predict", opt.N_PREDICT),
                         ("logprobs", opt.LOGPROBS), ("t_max_predict_ms", opt.T_MAX_PREDICT_MS)):
        for value in edges(option)[0]:
            assert serve_fields.int_field({name: value}, name, option) == value
        for value in edges(option)[1]:
            with pytest.raises(InvalidRequest, match=re.escape(f"{name} must be {option.range_text()}")):
                serve_fields.int_field({name: value}, name, option)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for option in (opt.REASONING_BUDGET, opt.MAX_TOTAL_TOKENS):   # the chat's fields of thinking models
        for value in edges(option)[0]:
            assert getattr(parse_chat({**chat, option.name: value}), option.name) == value
        for value in edges(option)[1]:
            with pytest.raises(InvalidRequest, match=re.escape(f"{option.name} must be {option.range_text()}")):
                parse_chat({**chat, option.name: value})
    with pytest.raises(InvalidRequest, match="json_schema must be a JSON object"):
        parse_chat({**chat, "json_schema": ["not", "a", "schema"]})


def test_serve_answers_400_past_the_bounds(client):
    past = {name: (edges(option)[1][-1], option.name) for name, option in SERVE_FIELDS.items()}
    past.update(max_tokens=(opt.MAX_TOKENS.max + 1, "max_tokens"), max_completion_tokens=(0, "max_completion_tokens"),
                seed=("7", "seed"), logprobs=(opt.LOGPROBS.max + 1, "logprobs"), n_predict=(-2, "n_predict"))
    for name, (value, said) in past.items():
        r = client.post("/v1/completions", json={"prompt": "hi", name: value})
        assert r.status_code == 400 and f"{said} must be" in r.json()["error"]["message"], (name, value, r.text)
    r = client.post("/infill", json={"input_prefix": "x", "t_max_predict_ms": opt.T_MAX_PREDICT_MS.max + 1})
    assert r.status_code == 400 and "t_max_predict_ms" in r.text


def test_the_load_options_table_in_the_docs_is_the_declarations():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    table = text.partition("## Load options")[2].partition("\n## ")[0]
    rows = {m[1]: (m[2].strip(), m[3].strip()) for m in re.finditer(r"^\| `(\w+)` \|([^|]*)\|(.*) \|$", table, re.M)}
    assert set(rows) == set(opt.LOAD_OPTIONS)
    for name, o in opt.LOAD_OPTIONS.items():
        assert rows[name] == ("none" if o.default is None else f"`{o.default}`", o.help), name
