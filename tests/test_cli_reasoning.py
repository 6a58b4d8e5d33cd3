"""`a3b generate` with a thinking model (the fake engine): the answer alone on stdout, the reasoning
on stderr (or first on stdout with --show-reasoning), and the options' bad values."""
from __future__ import annotations

import json

import pytest

from comfyui_a3b import cli

THINK = "fake://cli?template=qwen3&think=I+add+2+and+2.&text=It+is+4.&eos_after=41"
LOOP = "fake://cli-loop?template=qwen3&think=Hmm.&think_loop=1&text=Answer."


@pytest.fixture(autouse=True)
def _fake(fake_engine):
    from comfyui_a3b.runtime import get_runtime

    yield
    get_runtime().unload()


def gen(capsys, *argv):
    code = cli.main(["generate", "What is 2 + 2?", "--preset", "greedy", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_answer_on_stdout_reasoning_on_stderr(capsys):
    code, out, err = gen(capsys, "--model", THINK)
    assert code == 0 and out == "It is 4.\n"
    assert "I add 2 and 2." in err and "reasoning tokens" in err


def test_show_reasoning_prints_it_first_on_stdout(capsys):
    code, out, err = gen(capsys, "--model", THINK, "--show-reasoning")
    assert out == "I add 2 and 2.\n\nIt is 4.\n" and "I add 2" not in err


def test_thinking_off_and_template_vars(capsys):
    assert gen(capsys, "--model", THINK, "--thinking", "off", "--max-tokens", "8")[1] == "It is 4.\n"
    assert gen(capsys, "--model", THINK, "--template-var", "enable_thinking=false", "--max-tokens", "8")[1] == \
        "It is 4.\n"


def test_budget_and_json_output(capsys):
    code, out, _ = gen(capsys, "--model", LOOP, "--reasoning-budget", "3", "--max-tokens", "7", "--json")
    d = json.loads(out)
    assert (d["text"], d["n_reasoning_tokens"], d["reasoning_closed_by"]) == ("Answer.", 3, "budget")


def test_json_schema_file(capsys, tmp_path):
    f = tmp_path / "s.json"
    f.write_text('{"type": "object"}')
    assert gen(capsys, "--model", "fake://cli-js?text={}&eos_after=2", "--json-schema", str(f))[1] == "{}\n"


@pytest.mark.parametrize("argv,match", [
    (["--reasoning-budget", "-2"], "--reasoning-budget must be in 0..1048576, got -2"),
    (["--json-schema", "/nonexistent/s.json"], "no such file"),
    (["--thinking", "on", "--reasoning-budget", "0"], "contradicts itself"),
    (["--raw", "--template-var", "a=1"], "chat mode"),
])
def test_bad_values_are_one_line_errors(capsys, argv, match):
    code, _, err = gen(capsys, "--model", THINK, *argv)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1


def test_a_full_context_is_told_from_the_answer_alone(capsys):
    """The note that the context ran out compares --max-tokens with the answer's tokens, not with the
    reasoning's and the answer's together, and a stop at --max-total-tokens is not a full context."""
    code, out, _ = gen(capsys, "--model", THINK, "--n-ctx", "100", "--max-tokens", "20", "--json")
    d = json.loads(out)   # 24 reasoning and 11 answer tokens fill the context after the 65 of the prompt
    assert (d["finish_reason"], d["n_reasoning_tokens"], d["n_tokens"], d["context_full"]) == ("length", 24, 35, True)
    code, _, err = gen(capsys, "--model", THINK, "--n-ctx", "100", "--max-tokens", "20")
    assert "(65 prompt + 24 reasoning + 11 answer tokens of --n-ctx 100)" in err
    code, out, _ = gen(capsys, "--model", THINK, "--max-total-tokens", "10", "--json")
    d = json.loads(out)
    assert (d["finish_reason"], d["n_tokens"], d["context_full"]) == ("length", 10, False)


def test_bad_schema_file(capsys, tmp_path):
    f = tmp_path / "bad.json"
    f.write_text("[1, 2")
    code, _, err = gen(capsys, "--model", THINK, "--json-schema", str(f))
    assert code == 2 and "is not JSON" in err
