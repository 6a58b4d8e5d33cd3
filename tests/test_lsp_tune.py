"""a3b.tuneWorkspace: the language server runs `a3b tune` on a folder in a child process, reports its
progress as work-done progress and switches the editor to the adapter when it is better.

The server runs over the fake engine; the child tunes a tiny random llama GGUF for real (torch),
so this sits in the slow tier."""
from __future__ import annotations


import pytest
import pytest_asyncio
from lsprotocol import types as T
from pygls.exceptions import JsonRpcException

from lsp_helpers import folder_client, status
from tinygguf import write_tiny_gguf

pytest.importorskip("torch")
pytestmark = pytest.mark.slow


@pytest_asyncio.fixture(loop_scope="function")
async def client(tmp_path):
    async with folder_client(tmp_path) as c:
        yield c


def _repo(root):
    root.mkdir()
    for i in range(8):
        (root / f"m{i}.py").write_text("".join(f"def zz_{i}_{j}(q):\n    return q.zz({j})\n\n" for j in range(12)))
    return root


async def test_tune_workspace_reports_progress_and_switches_to_the_adapter(client, tmp_path):
    repo = _repo(tmp_path / "repo")
    tiny = write_tiny_gguf(tmp_path / "models" / "tiny.gguf", "llama")
    opts = {"model": str(tiny), "steps": 6, "seqLen": 48, "batch": 2, "lr": 0.02, "evalEvery": 3, "patience": 0,
            "device": "cpu"}
    res = await client.workspace_execute_command_async(T.ExecuteCommandParams(
        command="a3b.tuneWorkspace", arguments=[str(repo), opts]))
    assert res["heldout_files"] == 3 and res["steps"] == 6
    assert res["heldout_loss"] < res["heldout_loss_base"]
    assert res["used"] and "the new adapter is in use, held-out perplexity" in res["message"]
    assert res["adapter"].startswith(str(tmp_path / "cache" / "adapters"))
    st = await status(client)
    assert st["settings"]["lora"] == res["adapter"]
    reports = [p for reps in client.progress_reports.values() for p in reps
               if getattr(p, "title", "") == "A3B: tuning" or "step" in (getattr(p, "message", "") or "")]
    assert reports and reports[0].kind == "begin"
    assert any("held-out loss" in (p.message or "") for p in reports if p.kind == "report")


async def test_tune_workspace_refusals_come_back_as_errors(client, tmp_path):
    repo = _repo(tmp_path / "repo")
    tiny = write_tiny_gguf(tmp_path / "models" / "tiny.gguf", "llama")
    with pytest.raises(JsonRpcException, match="--rank must be in 1..1024"):
        await client.workspace_execute_command_async(T.ExecuteCommandParams(
            command="a3b.tuneWorkspace", arguments=[str(repo), {"model": str(tiny), "rank": 0}]))
    with pytest.raises(JsonRpcException, match="not an option name"):
        await client.workspace_execute_command_async(T.ExecuteCommandParams(
            command="a3b.tuneWorkspace", arguments=[str(repo), {"model; rm": 1}]))
    st = await status(client)
    assert st["settings"]["lora"] is None
