"""The editor settings: one declaration each (lsp_server/config.py SETTINGS), and the editors'
settings (VS Code's package.json and extension, the Neovim plugin, the examples, docs/editors.md)
in agreement with it.

Fast: reads files, no model.
"""
from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

from comfyui_a3b.lsp_server import config as cfg

ROOT = Path(__file__).resolve().parent.parent
VSCODE = ROOT / "editors" / "vscode"
JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def test_settings_fields_defaults_and_keys_come_from_the_declarations():
    assert [f.name for f in fields(cfg.Settings)] == [s.field for s in cfg.SETTINGS]
    base = cfg.Settings()
    for s in cfg.SETTINGS:
        assert getattr(base, s.field) == s.option.default, s.key
        assert cfg._KEYS[s.key] == (s.field, s.option)
        assert re.fullmatch(r"[a-z][a-zA-Z]*", s.key), s.key
    assert cfg._KEYS["modelPath"] == cfg._KEYS["model"]
    assert set(cfg._KEYS) == {k for s in cfg.SETTINGS for k in (s.key, *s.aliases)}
    assert cfg.BY_KEY["maxTokensSingleLine"].field == "max_tokens_single_line"
    assert cfg.BY_KEY["confidenceThreshold"].field == "confidence_threshold"
    assert cfg.LOAD_FIELDS == ("n_ctx", "cpu_moe", "n_cpu_moe", "override_tensor", "backend_sampling")


def test_what_a_setting_becomes_and_what_it_refuses():
    s, errors = cfg.apply(cfg.Settings(), {"fim": False, "model": "  ", "lora": "", "speculative": "ngram"})
    assert (s.fim, s.model, s.lora, s.speculative, errors) == ("off", None, None, "ngram", [])
    s2, errors = cfg.apply(s, {"speculative": "draft:", "warm": 1, "bogus": 1})
    assert s2 == s and len(errors) == 3
    assert errors[0] == "A3B setting 'speculative' must be text, or null; got 'draft:'. Keeping 'ngram'."
    assert errors[1] == "A3B setting 'warm' must be true or false; got 1. Keeping True."
    assert errors[2].startswith("Unknown A3B setting 'bogus' (known: backendSampling, chunkTokens, ")


def test_the_editors_own_keys_are_not_refused():
    """VS Code sends its whole `a3b` section on a change, the extension's own entries included."""
    assert cfg.apply(cfg.Settings(), {"a3b": {"command": "a3b", "server": "", "token": "t"}}) == (cfg.Settings(), [])


def _vscode_properties() -> dict[str, dict]:
    props = json.loads((VSCODE / "package.json").read_text())["contributes"]["configuration"]["properties"]
    assert all(k.startswith("a3b.") for k in props)
    return {k[len("a3b."):]: v for k, v in props.items()}


def test_vscode_package_json_declares_the_settings_as_the_server_does():
    for key, prop in _vscode_properties().items():
        if key in cfg.CLIENT_KEYS:
            continue
        assert key in cfg.BY_KEY, f"package.json: a3b.{key} is no setting of the server"
        option = cfg.BY_KEY[key].option
        kind = JSON_TYPES[option.type]
        assert prop["type"] == ([kind, "null"] if option.nullable else kind), key
        assert prop["default"] == option.default, key
        assert prop.get("enum") == (list(option.choices) if option.choices else None), key
        assert (prop.get("minimum"), prop.get("maximum")) == ((option.min, option.max) if kind in (
            "integer", "number") else (None, None)), key


def test_vscode_extension_sends_every_setting_it_declares():
    source = (VSCODE / "src" / "extension.ts").read_text()
    sent = json.loads(re.search(r"const SETTINGS = (\[[^\]]*\]);", source)[1])
    assert set(sent) == set(_vscode_properties()) - set(cfg.CLIENT_KEYS)


def _lua_settings(path: Path) -> dict[str, str]:
    block = re.search(r"settings = \{([^}]*)\}", path.read_text())[1]
    return dict(re.findall(r"(\w+) = ([^,\s]+)", block))


def test_neovim_and_example_settings_are_declared_with_their_defaults():
    for path in (ROOT / "editors" / "neovim" / "lua" / "a3b.lua", ROOT / "examples" / "editors" / "init.lua"):
        for key, value in _lua_settings(path).items():
            assert key in cfg.BY_KEY, f"{path.name}: {key}"
            assert value == json.dumps(cfg.BY_KEY[key].option.default), (path.name, key)
    example = json.loads((ROOT / "examples" / "editors" / "settings.json").read_text())
    for name, value in example.items():
        if name.startswith("a3b.") and name[4:] not in cfg.CLIENT_KEYS:
            assert value == cfg.BY_KEY[name[4:]].option.default, name


def test_docs_list_every_setting():
    text = (ROOT / "docs" / "editors.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    assert {s.key for s in cfg.SETTINGS} <= listed
