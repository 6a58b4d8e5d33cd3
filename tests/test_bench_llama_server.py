"""bench/llama_server.py's llama-server cache: where it lives, what is missing to build it, one build at a
time (fast tier: the build itself is replaced by a stand-in; the slow tier's test_llama_server.py
builds the real one)."""
from __future__ import annotations

import os
import threading
import time

import pytest

from comfyui_a3b.bench import llama_server

posix_only = pytest.mark.skipif(os.name == "nt", reason="the stand-in binary is a shell script")


def test_cache_path_keyed_by_the_binding_version(monkeypatch, tmp_path):
    import importlib.metadata

    monkeypatch.setenv("A3B_CACHE", str(tmp_path))
    version = importlib.metadata.version("llama-cpp-python")
    assert llama_server.llama_server_path().parent == tmp_path / "llama-server" / version


def test_missing_tools_are_named(monkeypatch, tmp_path):
    monkeypatch.setenv("A3B_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    assert llama_server.missing_build_tools() == ["cmake", "a C compiler", "a C++ compiler"]
    built = []
    monkeypatch.setattr(llama_server, "_build", built.append)
    with pytest.raises(llama_server.BuildToolsMissing,
                       match="needs cmake, a C compiler and a C[+][+] compiler on PATH"):
        llama_server.llama_server_binary(say=lambda m: None)
    assert not built


@posix_only
def test_one_build_for_concurrent_callers(monkeypatch, tmp_path):
    """Two callers at once: one builds (and says so), the other waits and takes its result; a later
    call finds the cached binary. The binary appears only once complete."""
    monkeypatch.setenv("A3B_CACHE", str(tmp_path))
    monkeypatch.setattr(llama_server, "missing_build_tools", lambda: [])
    builds, said, seen_partial = [], [], []

    def fake_build(target):
        builds.append(target)
        time.sleep(0.5)
        seen_partial.append(target.exists())
        partial = target.with_name(target.name + ".partial")
        partial.write_text("#!/bin/sh\necho 'version: 0'\n")
        partial.chmod(0o755)
        os.replace(partial, target)

    monkeypatch.setattr(llama_server, "_build", fake_build)
    out = []
    threads = [threading.Thread(target=lambda: out.append(llama_server.llama_server_binary(say=said.append)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(builds) == 1 and seen_partial == [False]
    assert len(out) == 2 and out[0] == out[1] == llama_server.llama_server_path()
    assert len(said) == 2 and "several minutes" in said[0]
    assert llama_server.llama_server_binary(say=said.append) == out[0] and len(builds) == 1


@posix_only
def test_a_cached_binary_that_does_not_run_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("A3B_CACHE", str(tmp_path))
    monkeypatch.setattr(llama_server, "missing_build_tools", lambda: [])
    target = llama_server.llama_server_path()
    target.parent.mkdir(parents=True)
    target.write_text("#!/bin/sh\nexit 1\n")
    target.chmod(0o755)
    builds = []

    def fake_build(t):
        builds.append(t)
        t.write_text("#!/bin/sh\necho 'version: 0'\n")

    monkeypatch.setattr(llama_server, "_build", fake_build)
    assert llama_server.llama_server_binary(say=lambda m: None) == target and builds == [target]


def test_only_the_vendored_tree_is_extracted(tmp_path):
    import io
    import tarfile

    sdist = tmp_path / "llama_cpp_python-9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name in ("llama_cpp_python-9.9/pyproject.toml", "llama_cpp_python-9.9/vendor/llama.cpp/CMakeLists.txt",
                     "llama_cpp_python-9.9/vendor/llama.cpp/tools/server/server.cpp"):
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    src = llama_server._extract_vendored(sdist, tmp_path / "src")
    assert src == tmp_path / "src" / "llama_cpp_python-9.9" / "vendor" / "llama.cpp"
    assert (src / "tools" / "server" / "server.cpp").is_file()
    assert not (tmp_path / "src" / "llama_cpp_python-9.9" / "pyproject.toml").exists()
