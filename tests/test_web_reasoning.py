"""The web extension's reasoning box, run in Node with small stand-ins for ComfyUI's frontend objects
(fast tier): reasoning events fill a collapsed box of their own, answer events the stream widget."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

JS = Path(__file__).resolve().parent.parent / "web" / "a3b.js"

HARNESS = r"""
import { readFileSync } from "fs";
const src = readFileSync(process.argv[2], "utf8").replace(/^import .*$/mg, "");
const handlers = {}, ext = [];
const el = () => { const parts = { summary: { textContent: "" }, pre: { textContent: "", scrollHeight: 0 } };
  return { classList: { add() {} }, style: {}, hidden: false, set innerHTML(v) {}, querySelector: (s) => parts[s] }; };
globalThis.document = { createElement: el, head: { appendChild() {} }, body: { appendChild() {} } };
globalThis.setInterval = () => 0;
const stubs = {
  app: { registerExtension: (e) => ext.push(e), graph: { getNodeById: () => node } },
  api: { addEventListener: (n, f) => { handlers[n] = f; }, fetchApi: async () => ({ ok: false, status: 0 }) },
  ComfyWidgets: { STRING: (n, name) => { const w = { name, value: "" }; n.widgets.push(w); return { widget: w }; } },
};
const node = { widgets: [], addDOMWidget(name, type, box) { this.box = box; return { name }; } };
const mod = await import("data:text/javascript," + encodeURIComponent(
  "const {app, api, ComfyWidgets} = globalThis.__stubs;" + src));
"""

RUN = r"""
await ext[0].setup();
const send = (n, d) => handlers[n]({ detail: { node: 1, ...d } });
send("a3b.token", { text: "", reset: true });
send("a3b.token", { reasoning: "I think ", n: 1 });
send("a3b.token", { reasoning: "hard.", n: 2 });
send("a3b.token", { text: "Answer", n: 3 });
const during = node.box.querySelector("summary").textContent;
send("a3b.done", { n_tokens: 3 });
console.log(JSON.stringify({ stream: node.widgets[0].value, reasoning: node.box.querySelector("pre").textContent,
  hidden: node.box.hidden, during, after: node.box.querySelector("summary").textContent }));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_reasoning_streams_into_its_own_collapsed_box(tmp_path):
    script = tmp_path / "t.mjs"
    # the stubs must exist before the module body runs: define them first, then import
    head, imp = HARNESS.split("const mod = ")
    script.write_text(head + "globalThis.__stubs = stubs;\nconst mod = " + imp + RUN)
    out = subprocess.run(["node", str(script), str(JS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["stream"] == "Answer" and got["reasoning"] == "I think hard."
    assert got["hidden"] is False and got["during"] == "Reasoning\u2026 (3 words)"
    assert got["after"] == "Reasoning (3 words)"
