-- Neovim 0.11+: A3B inline completions and quick fixes.
-- Put editors/neovim from the comfyui-a3b repository on the runtime path (or copy lua/a3b.lua
-- into ~/.config/nvim/lua/), then:
vim.opt.rtp:prepend(vim.fn.expand("~/src/comfyui-a3b/editors/neovim"))

require("a3b").setup({
  -- A private server over stdio (needs `pip install comfyui-a3b`):
  cmd = { "a3b", "lsp", "--stdio" },
  -- Or share one running server (and its loaded model) with other editors and ComfyUI:
  -- tcp = "127.0.0.1:7011", token = os.getenv("A3B_LSP_TOKEN"),
  settings = { debounceMs = 40, maxTokens = 64, contextChunks = 2 },
  auto_trigger = false,   -- true: ask after every pause in typing
  -- insert mode: <M-l> ask, <M-y> or <Tab> accept, <C-]> dismiss; normal mode: <leader>af fix
})
