"""Patterns over user text stay linear (fast tier): each one with long adversarial input, under a time
bound that a quadratic pattern misses by far.

The calls run in a child process with a timeout, so a pattern that backtracks for minutes fails
the test instead of stalling the suite; the language server's own requests run against a real
server process over the fake engine.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from lsp_helpers import FAKE_MODEL, FAKE_SERVER, RawClient

#: seconds each adversarial call may take: a linear pattern needs milliseconds, the quadratic ones
#: they replace took minutes at these sizes
BOUND_S = 5.0

#: (what, setup code, the call): each run on a few hundred thousand characters
CASES = {
    "a long word that does not end the line": (
        "from comfyui_a3b.lsp_server.postprocess import word_before\nline = 'x = ' + 'a' * 300_000 + ')'",
        "assert word_before(line) == '' and len(word_before(line[:-1])) == 300_000"),
    "a traceback header and many blank lines": (
        "from comfyui_a3b.lsp_server.fixes import parse_traceback\n"
        "text = 'Traceback (most recent call last):\\n' + '\\n' * 200_000",
        "assert parse_traceback(text) is None"),
    "frame lines of blanks, an unterminated path": (
        "from comfyui_a3b.lsp_server.fixes import parse_traceback\n"
        "text = 'Traceback (most recent call last):\\n' + (' ' * 2000 + '\\n') * 100 + 'File \"' * 100_000",
        "assert parse_traceback(text) is None"),
    "an error line of one long word": (
        "from comfyui_a3b.lsp_server.fixes import parse_traceback\n"
        "text = 'Traceback (most recent call last):\\n  File \"a.py\", line 3\\n' + 'a.' * 300_000",
        "assert parse_traceback(text).frames[0].line == 3"),
    "a fence the model never closes": (
        "from comfyui_a3b.lsp_server.fixes import extract_code\nanswer = '```' + ' ```x' * 100_000",
        "extract_code(answer, 'x')"),
    "a llama.cpp log line without blanks": (
        "from pathlib import Path\nfrom comfyui_a3b.runtime.models.vet import _message\n"
        "v = {'status': 'crash', 'signal': 'SIGSEGV', 'log': 'error: ' + '/a' * 200_000}",
        "assert 'SIGSEGV' in _message(Path('m.gguf'), v)"),
    "line ends of a document": (
        "from comfyui_a3b.lsp_server.documents import Document\ntext = '\\r' * 300_000 + '\\n' * 300_000",
        "assert Document('file:///d', text).line_count() == 600_000"),
    "remote token estimates of long blank runs": (
        "from comfyui_a3b.runtime.remote.wire import estimate_tokens\n"
        "text = (' ' * 50_000 + 'x') * 6 + '\\t' * 100_000",
        "estimate_tokens(text)"),
}


@pytest.mark.parametrize("what", list(CASES))
def test_patterns_over_user_text_are_linear(what):
    setup, call = CASES[what]
    code = setup + "\nimport time\nt0 = time.perf_counter()\n" + call + "\nprint(time.perf_counter() - t0)\n"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=BOUND_S + 30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: still running after {BOUND_S + 30:g} s")
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < BOUND_S, (what, out.stdout)


async def _answered_within(requests, timeout: float) -> tuple[list[dict], float]:
    """Open one document, send `requests` (method, params) to a fresh fake-engine server; the
    responses and the seconds they took."""
    raw = await RawClient.stdio("--model", FAKE_MODEL, server=FAKE_SERVER)
    try:
        await raw.initialize(options={"debounceMs": 0},
                             capabilities={"textDocument": {"codeAction": {"codeActionLiteralSupport": {
                                 "codeActionKind": {"valueSet": ["quickfix"]}}}}})
        t0 = time.monotonic()
        for i, (method, params) in enumerate(requests):
            if i == 0:
                raw.notify(method, params)
            else:
                raw.request(i, method, params)
        out = [await raw.response(i, timeout=timeout) for i in range(1, len(requests))]
        return out, time.monotonic() - t0
    finally:
        raw.proc.kill()
        await raw.proc.wait()


def _open(uri: str, text: str):
    return "textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": text}}


@pytest.mark.asyncio
async def test_completion_after_a_long_word_answers_at_once(fake_engine):
    uri = "file:///w/word.py"
    line = "x = " + "a" * 200_000 + " "     # the cursor after the word and a blank: nothing is typed
    [res], took = await _answered_within([_open(uri, line + "\n"), (
        "textDocument/completion", {"textDocument": {"uri": uri}, "position": {"line": 0, "character": len(line)}})],
        timeout=BOUND_S + 10)
    item = res["result"]["items"][0]
    assert item["textEdit"]["range"]["start"]["character"] == len(line)   # no word to replace
    assert took < BOUND_S, took


@pytest.mark.asyncio
async def test_code_action_on_a_traceback_and_many_blank_lines_answers_at_once(fake_engine):
    uri = "file:///w/trace.py"
    text = "Traceback (most recent call last):\n" + "\n" * 60_000
    [res], took = await _answered_within([_open(uri, text), ("textDocument/codeAction", {
        "textDocument": {"uri": uri},
        "range": {"start": {"line": 0, "character": 0}, "end": {"line": 60_001, "character": 0}},
        "context": {"diagnostics": []}})], timeout=BOUND_S + 10)
    titles = [a["title"] for a in res["result"]]
    assert titles == ["Explain with A3B"], titles      # a header without frames is no traceback
    assert took < BOUND_S, took

