"""Where tuning reads and writes: `a3b tune --out` never replaces a link or something that is not a
regular file (a device node, a pipe), and the language server's a3b.tuneWorkspace takes models from
the model folders and writes adapters only into the cache folder or a LoRA folder (fast tier: every
refusal comes before the tuning child starts)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import pytest_asyncio
from lsprotocol import types as T
from pygls.exceptions import JsonRpcException

from comfyui_a3b.runtime.errors import InvalidRequest

from lsp_helpers import folder_client, status
from tinygguf import write_tiny_gguf


def _repo(root):
    root.mkdir()
    for i in range(8):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    return root


def test_tune_refuses_an_output_that_is_a_link_or_not_a_regular_file(tmp_path):
    from comfyui_a3b.tune.adapter import check_writable

    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    target = tmp_path / "target.gguf"
    target.write_bytes(b"keep")
    link = tmp_path / "link.gguf"
    link.symlink_to(target)
    with pytest.raises(InvalidRequest, match="is not a regular file"):
        check_writable(fifo)
    with pytest.raises(InvalidRequest, match="is a link"):
        check_writable(link)
    assert check_writable(target) == target   # an existing adapter file is replaced, as before
    repo = _repo(tmp_path / "repo")
    base = write_tiny_gguf(tmp_path / "l.gguf")
    for out, words in ((fifo, "is not a regular file"), (link, "is a link"), ("/dev/null", "is not a regular file")):
        r = subprocess.run([sys.executable, "-m", "comfyui_a3b.cli", "tune", str(repo), "--model", str(base),
                            "--out", str(out)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and words in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert stat.S_ISFIFO(fifo.stat().st_mode) and link.is_symlink() and target.read_bytes() == b"keep"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_writing_never_goes_through_a_link_left_as_the_part_file(tmp_path):
    import numpy as np

    from comfyui_a3b.tune.adapter import write

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    out = tmp_path / "a.gguf"
    (tmp_path / "a.gguf.part").symlink_to(victim)
    write(out, "llama", 16.0, {"blk.0.attn_q.weight": (np.zeros((2, 8)), np.zeros((8, 2)))}, {})
    assert victim.read_bytes() == b"keep" and out.is_file() and not out.is_symlink()


@pytest_asyncio.fixture(loop_scope="function")
async def client(tmp_path):
    async with folder_client(tmp_path) as c:
        yield c


async def _refused(client, repo, opts, words):
    with pytest.raises(JsonRpcException, match=words):
        await client.workspace_execute_command_async(T.ExecuteCommandParams(
            command="a3b.tuneWorkspace", arguments=[str(repo), opts]))


async def test_tune_workspace_reads_models_and_writes_adapters_only_in_their_folders(client, tmp_path):
    repo = _repo(tmp_path / "repo")
    outside = write_tiny_gguf(tmp_path / "outside.gguf", "llama")
    inside = write_tiny_gguf(tmp_path / "models" / "tiny.gguf", "llama")
    (tmp_path / "cache" / "adapters").mkdir(parents=True)
    link = tmp_path / "cache" / "adapters" / "link.gguf"
    link.symlink_to(tmp_path / "victim.gguf")
    await _refused(client, repo, {"model": str(outside)}, "outside the allowed model folders")
    await _refused(client, repo, {"model": "../outside.gguf"}, "outside the allowed model folders")
    for out in (str(tmp_path / "anywhere.gguf"), "/dev/full", "../../anywhere.gguf"):
        await _refused(client, repo, {"model": str(inside), "out": out}, "outside the adapters' folders|not a regular")
    await _refused(client, repo, {"model": str(inside), "out": str(link)}, "is a link or not a regular file")
    await _refused(client, repo, {"model": str(inside), "out": str(tmp_path / "cache" / "adapters" / "a.txt")},
                   "must be a .gguf file name")
    # a3b tune's parser takes a prefix of a flag: "o" would be --out, "mod" --model
    for key in ("o", "mod", "progressJson", "json"):
        await _refused(client, repo, {"model": str(inside), key: "/tmp/x.gguf"}, f"unknown option '{key}'")
    assert not (tmp_path / "anywhere.gguf").exists() and not (tmp_path / "victim.gguf").exists()
    assert (await status(client))["settings"]["lora"] is None
