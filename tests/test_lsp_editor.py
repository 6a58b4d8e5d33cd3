"""The language server as an editor user meets it, at the embedded model (slow tier): a fresh
`a3b lsp --stdio` with the default settings, real third-party source files opened one after another,
and an inline completion asked for inside each right after opening it.

Opening a second and third file starts context indexing (embeddings of the other files' chunks) and
prompt prewarming at batch priority; none of it may keep a completion waiting.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from lsp_helpers import SERVER, RawClient

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

#: installed dependencies of the language server: real third-party code, 1-7 KB each
SOURCES = ("pygls/uris.py", "pygls/progress.py", "pygls/exceptions.py")
#: a loaded 2-core machine answers each completion of this scenario in 5-15 s; before the scheduler
#: counted queued interactive requests, the third waited behind indexing for minutes
ANSWER_WITHIN_S = 60.0


def third_party_sources(tmp_path: Path) -> list[Path]:
    """Copies of real third-party source files (from the installed packages) in `tmp_path`."""
    import pygls

    site = Path(pygls.__file__).resolve().parent.parent
    out = []
    for rel in SOURCES:
        text = (site / rel).read_text(encoding="utf-8")
        assert 1000 <= len(text.encode()) <= 7000, (rel, len(text))
        dst = tmp_path / rel.replace("/", "_")
        dst.write_text(text, encoding="utf-8")
        out.append(dst)
    return out


def indented_spots(text: str) -> list[tuple[int, int]]:
    """(line, character) at the end of indented lines that open a block (`if ...:`, `def ...:`),
    from the middle of the file on: where an editor user asks for the block's body."""
    lines = text.split("\n")
    return [(i, len(ln)) for i, ln in enumerate(lines) if i >= len(lines) // 3 and ln.startswith("    ")
            and ln.rstrip().endswith(":") and not ln.lstrip().startswith("#")]


async def test_completions_answer_promptly_as_files_are_opened_one_after_another(tmp_path):
    files = third_party_sources(tmp_path)
    raw = await RawClient.stdio(server=SERVER)
    latencies: list[float] = []
    ids = iter(range(1, 1000))

    async def complete(uri: str, spot: tuple[int, int]) -> None:
        id_ = next(ids)
        t0 = time.monotonic()
        raw.request(id_, "textDocument/inlineCompletion", {
            "textDocument": {"uri": uri}, "position": {"line": spot[0], "character": spot[1]},
            "context": {"triggerKind": 2}})
        res = await raw.response(id_, timeout=ANSWER_WITHIN_S)
        latencies.append(round(time.monotonic() - t0, 2))
        assert "result" in res, res

    try:
        assert "result" in await raw.initialize()      # the default settings
        opened = []
        for path in files:          # each file opened, then a completion inside it at once
            text = path.read_text(encoding="utf-8")
            uri = path.as_uri()
            raw.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python",
                                                                 "version": 1, "text": text}})
            spots = indented_spots(text)
            assert len(spots) >= 2, path
            opened.append((uri, spots))
            await complete(uri, spots[0])
        for uri, spots in opened:   # and once more in each while the files are still being indexed
            await complete(uri, spots[-1])
        raw.request(999, "workspace/executeCommand", {"command": "a3b.status"})
        st = (await raw.response(999))["result"]
        # the scenario did what it is about: indexing ran beside the completions
        assert st["runtime"]["models"][0]["stats"].get("embedded_texts", 0) > 0, st["runtime"]
        print("completion latencies (s):", latencies)
    finally:
        raw.request(1000, "shutdown")
        raw.notify("exit")
        await raw.close()
