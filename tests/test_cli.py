"""The `a3b` command as a user runs it (a real subprocess, real model)."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import numpy as np
import pytest

A3B = shutil.which("a3b") or pytest.fail("the a3b console script is not installed (pip install -e .)")


def a3b(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([A3B, *args], capture_output=True, text=True, timeout=timeout)


def test_generate_streams_and_same_seed_gives_same_text():
    args = ["generate", "Write a short line about the moon.", "--max-tokens", "20", "--temperature", "0.9",
            "--seed", "42", "--top-k", "50", "--top-p", "0.95", "--min-p", "0.02", "--repeat-penalty", "1.1"]
    a, b = a3b(*args), a3b(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
    assert "tokens/s" in a.stderr and "time to first token" in a.stderr and "seed 42" in a.stderr


def test_generate_with_system_stop_and_json():
    p = a3b("generate", "Count: 1, 2, 3, 4, 5,", "--raw", "--preset", "greedy", "--stop", " 7", "--json",
            "--max-tokens", "20")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["finish_reason"] == "stop" and "7" not in res["text"]
    s = a3b("generate", "Who are you?", "--system", "You are a pirate.", "--max-tokens", "8", "--preset", "greedy")
    assert s.returncode == 0 and s.stdout.strip()


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


def test_inspect_default_and_unknown_arch(default_path, tmp_path):
    p = a3b("inspect", str(default_path), "--json")
    assert p.returncode == 0, p.stderr
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


def test_verify(tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(b"x" * 3_000_000)
    good = hashlib.sha256(f.read_bytes()).hexdigest()
    ok = a3b("verify", str(f), "--sha256", good)
    assert ok.returncode == 0 and good in ok.stdout
    bad = a3b("verify", str(f), "--sha256", "1" * 64, "--quiet")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "mismatch" in bad.stderr


@pytest.mark.parametrize("args,needle", [
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], "not found"),
    (["generate", "", "--max-tokens", "4"], "empty"),
    (["generate", "hi", "--top-p", "2"], "top_p"),
    (["inspect", "/etc/hostname"], "not a GGUF"),
])
def test_user_errors_are_one_line_and_exit_2(args, needle):
    p = a3b(*args)
    assert p.returncode == 2
    assert p.stderr.startswith("a3b: error:") and needle in p.stderr and p.stderr.count("\n") == 1


def test_doctor():
    p = a3b("doctor", timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    for key in ("python", "llama-cpp-python", "llama.cpp build", "GPU offload", "default model", "generation"):
        assert key in p.stdout
    assert "ERR" not in p.stdout
