-- A3B for Neovim 0.11+: the language server through vim.lsp.config, and inline completion
-- (textDocument/inlineCompletion, LSP 3.18) shown as virtual text, since Neovim 0.11 has no
-- built-in inline completion UI.
--
--   require("a3b").setup()                                   -- starts `a3b lsp --stdio`
--   require("a3b").setup({ tcp = "127.0.0.1:7011", token = "..." })  -- a shared server
--
-- Insert mode: <M-l> asks for a completion, <M-y> (or <Tab> while one is shown) accepts it,
-- <C-]> dismisses it. Normal mode: <leader>af runs "Fix with A3B" for the diagnostics on the line
-- (from any linter); vim.lsp.buf.code_action() offers the same fixes for A3B's own diagnostics and
-- for a pasted traceback.

local M = {}

local ns = vim.api.nvim_create_namespace("a3b_inline")

M.defaults = {
  cmd = { "a3b", "lsp", "--stdio" },
  tcp = nil,                -- "HOST:PORT" of a running `a3b lsp --tcp` (or the ComfyUI in-process server)
  token = nil,              -- its token (A3B_LSP_TOKEN)
  filetypes = nil,          -- nil: every filetype
  settings = { debounceMs = 40 },
  auto_trigger = false,     -- ask after each pause in typing, not only on the keymap
  auto_trigger_ms = 120,
  keys = { request = "<M-l>", accept = "<M-y>", accept_tab = true, dismiss = "<C-]>", fix = "<leader>af" },
}

M.state = nil          -- { bufnr, row, col, text, item, client_id }
M.last_result = nil    -- the last answer, for scripts and tests

local function client_for(bufnr)
  return vim.lsp.get_clients({ bufnr = bufnr, name = "a3b" })[1]
end

function M.clear()
  if M.state then
    pcall(vim.api.nvim_buf_clear_namespace, M.state.bufnr, ns, 0, -1)
  end
  M.state = nil
end

local function show(bufnr, row, col, text)
  local lines = vim.split(text, "\n", { plain = true })
  local opts = { virt_text = { { lines[1], "Comment" } }, virt_text_pos = "inline", hl_mode = "combine" }
  if #lines > 1 then
    opts.virt_lines = {}
    for i = 2, #lines do
      table.insert(opts.virt_lines, { { lines[i], "Comment" } })
    end
  end
  vim.api.nvim_buf_set_extmark(bufnr, ns, row, col, opts)
end

--- Ask the server for an inline completion at the cursor (or at `pos` = { row (1-based), col (0-based
--- byte) }, for scripts); `cb(text)` gets the suggestion ("" if none).
function M.request(cb, pos)
  local bufnr = vim.api.nvim_get_current_buf()
  local client = client_for(bufnr)
  if not client then
    vim.notify("A3B: the language server is not attached to this buffer", vim.log.levels.WARN)
    return
  end
  M.clear()
  local win = vim.api.nvim_get_current_win()
  local cursor = pos or vim.api.nvim_win_get_cursor(win)
  local params = {
    textDocument = vim.lsp.util.make_text_document_params(bufnr),
    position = { line = cursor[1] - 1,
                 character = vim.lsp.util.character_offset(bufnr, cursor[1] - 1, cursor[2], client.offset_encoding) },
    context = { triggerKind = 1 },  -- Invoked
  }
  client:request("textDocument/inlineCompletion", params, function(err, result)
    if err then
      M.last_result = { error = err.message }
      vim.notify("A3B: " .. err.message, vim.log.levels.WARN)
      if cb then cb("") end
      return
    end
    local items = result and (result.items or result) or {}
    local item = items[1]
    local text = item and (type(item.insertText) == "table" and item.insertText.value or item.insertText) or ""
    M.last_result = { text = text }
    local now = pos or vim.api.nvim_win_get_cursor(0)
    if text ~= "" and vim.api.nvim_get_current_buf() == bufnr and now[1] == cursor[1] and now[2] == cursor[2] then
      M.state = { bufnr = bufnr, row = cursor[1] - 1, col = cursor[2], text = text, item = item, client_id = client.id }
      show(bufnr, cursor[1] - 1, cursor[2], text)
    end
    if cb then cb(text) end
  end, bufnr)
end

--- Insert the suggestion shown; returns false when there is none.
function M.accept()
  local st = M.state
  if not st then
    return false
  end
  M.clear()
  local lines = vim.split(st.text, "\n", { plain = true })
  vim.api.nvim_buf_set_text(st.bufnr, st.row, st.col, st.row, st.col, lines)
  local last_row = st.row + #lines - 1
  local last_col = (#lines == 1) and (st.col + #lines[1]) or #lines[#lines]
  pcall(vim.api.nvim_win_set_cursor, 0, { last_row + 1, last_col })
  local client = vim.lsp.get_client_by_id(st.client_id)
  if client and st.item.command then
    client:exec_cmd(st.item.command, { bufnr = st.bufnr })  -- lets the server mark unsure parts
  end
  return true
end

--- "Fix with A3B" for the diagnostics on the cursor's line, from every source (Neovim's own
--- code_action() only sends a server the diagnostics that server published itself).
function M.fix()
  local bufnr = vim.api.nvim_get_current_buf()
  local lnum = vim.api.nvim_win_get_cursor(0)[1] - 1
  local diags = vim.lsp.diagnostic.from(vim.diagnostic.get(bufnr, { lnum = lnum }))
  vim.lsp.buf.code_action({
    context = { diagnostics = diags },
    apply = true,
    filter = function(a)
      return a.title:find("with A3B", 1, true) ~= nil and a.title ~= "Explain with A3B"
    end,
  })
end

function M.setup(opts)
  opts = vim.tbl_deep_extend("force", M.defaults, opts or {})
  local cmd = opts.cmd
  if opts.tcp then
    local host, port = opts.tcp:match("^(.*):(%d+)$")
    cmd = vim.lsp.rpc.connect(host, tonumber(port))
  end
  local init = vim.deepcopy(opts.settings)
  init.token = opts.token
  vim.lsp.config("a3b", {
    cmd = cmd,
    filetypes = opts.filetypes,
    root_markers = { ".git", "pyproject.toml", "package.json" },
    init_options = init,
    settings = { a3b = opts.settings },
  })
  vim.lsp.enable("a3b")

  local k = opts.keys
  vim.keymap.set("i", k.request, function() M.request() end, { desc = "A3B: inline completion" })
  vim.keymap.set("i", k.accept, function() M.accept() end, { desc = "A3B: accept completion" })
  vim.keymap.set("i", k.dismiss, function() M.clear() end, { desc = "A3B: dismiss completion" })
  if k.fix then
    vim.keymap.set("n", k.fix, M.fix, { desc = "A3B: fix the diagnostics on this line" })
  end
  if k.accept_tab then
    vim.keymap.set("i", "<Tab>", function()
      if not M.accept() then
        vim.api.nvim_feedkeys(vim.api.nvim_replace_termcodes("<Tab>", true, false, true), "n", false)
      end
    end, { desc = "A3B: accept completion or insert a tab" })
  end

  local group = vim.api.nvim_create_augroup("a3b_inline", { clear = true })
  vim.api.nvim_create_autocmd({ "InsertLeave", "BufLeave" }, { group = group, callback = M.clear })
  -- Where the cursor rests (A3B's own a3b/cursor notification): the server reads the prompt a
  -- completion there would use, so the first suggestion in a buffer is as quick as later ones.
  vim.api.nvim_create_autocmd({ "CursorHold", "CursorHoldI", "BufEnter" }, {
    group = group,
    callback = function(ev)
      local client = client_for(ev.buf)
      if client then
        local pos = vim.lsp.util.make_position_params(0, client.offset_encoding)
        client:notify("a3b/cursor", pos)
      end
    end,
  })
  if opts.auto_trigger then
    local timer = vim.uv.new_timer()
    vim.api.nvim_create_autocmd("TextChangedI", {
      group = group,
      callback = function()
        M.clear()
        timer:stop()
        timer:start(opts.auto_trigger_ms, 0, vim.schedule_wrap(function()
          if vim.fn.mode() == "i" then M.request() end
        end))
      end,
    })
  end
end

return M
