"""Speculative decoding's controls and statistics on every surface, over the fake engine: `a3b
generate`'s flag and summary line, `a3b serve`'s request fields and usage, the language server's
setting, A3B Loader's widgets."""
from __future__ import annotations


from comfyui_a3b.runtime import options as opt

from serve_helpers import TOKEN, client, server  # noqa: F401 - fixtures


def test_serve_reports_accepted_predictions_and_refuses_bad_fields(client):  # noqa: F811
    body = {"prompt": "x", "max_tokens": 90, "temperature": 0}
    on = client.post("/v1/completions", json={**body, "speculative": "ngram"}).json()
    off = client.post("/v1/completions", json={**body, "speculative": "off"}).json()
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    details = on["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 30
    assert off["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    for bad in ({"speculative": "sometimes"}, {"speculative": 3}, {"draft_max": 0}, {"draft_max": 2.5},
                {"speculative": "mtp"}):
        r = client.post("/v1/completions", json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (bad, r.text)


def test_generate_has_the_flags_and_its_summary_counts_drafts(fake_engine, capsys):
    from comfyui_a3b.cli import main

    assert main(["generate", "--model", "fake://cli", "--raw", "--max-tokens", "80", "--temperature", "0",
                 "--speculative", "ngram", "--draft-max", "6", "Hi"]) == 0
    err = capsys.readouterr().err
    assert "drafted tokens accepted" in err
    assert main(["generate", "--model", "fake://cli", "--draft-max", "0", "Hi"]) == 2
    assert "--draft-max must be in 1..64" in capsys.readouterr().err


def test_language_server_setting_and_loader_widgets():
    from comfyui_a3b.lsp_server.config import Settings, apply
    from comfyui_a3b.nodes.defs import LOADER

    s, errors = apply(Settings(), {"speculative": "off"})
    assert s.speculative == "off" and not errors
    s2, errors = apply(s, {"speculative": "whenever"})
    assert s2.speculative == "off" and errors and "speculative" in errors[0]
    names = {i.name: i for i in LOADER.inputs}
    assert names["speculative"].option is opt.SPECULATIVE and names["draft_max"].option is opt.DRAFT_MAX
