"""The web extension's output widget, run in Node with small stand-ins for ComfyUI's frontend objects
(fast tier): reasoning events fill a collapsed box of their own above the answer, answer events the
answer box, a note from the backend shows beside them; inputs marked advanced are found."""
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
const part = () => ({ hidden: true, open: false, textContent: "", value: "", scrollHeight: 0, addEventListener() {} });
const el = () => { const parts = { details: part(), summary: part(), pre: part(), div: part(), textarea: part() };
  return { classList: { add() {} }, style: {}, hidden: false, set innerHTML(v) {}, querySelector: (s) => parts[s] }; };
globalThis.document = { createElement: el, head: { appendChild() {} }, body: { appendChild() {} } };
globalThis.setInterval = () => 0;
const stubs = {
  app: { registerExtension: (e) => ext.push(e), graph: { getNodeById: () => node } },
  api: { addEventListener: (n, f) => { handlers[n] = f; }, fetchApi: async () => ({ ok: false, status: 0 }) },
};
const node = { widgets: [], size: [400, 300], addDOMWidget(name, type, box, opts) {
  this.box = box; const w = { name, options: opts, get value() { return opts.getValue(); } };
  this.widgets.push(w); return w; },
  computeSize() { return [400, 60 + this.widgets[0].options.getMinHeight()]; }, setSize(s) { this.size = s; } };
const mod = await import("data:text/javascript," + encodeURIComponent(
  "const {app, api} = globalThis.__stubs;" + src));
"""

RUN = r"""
await ext[0].setup();
const send = (n, d) => handlers[n]({ detail: { node: 1, ...d } });
send("a3b.token", { text: "", reset: true });
const before = node.widgets[0].options.getMinHeight();
send("a3b.token", { reasoning: "I think ", n: 1 });
send("a3b.token", { reasoning: "hard.", n: 2 });
send("a3b.token", { text: "Answer", n: 3 });
const q = (s) => node.box.querySelector(s);
const during = q("summary").textContent;
send("a3b.done", { n_tokens: 3, note: "The reasoning used all 2 tokens" });
console.log(JSON.stringify({ stream: node.widgets[0].value, reasoning: q("pre").textContent,
  hidden: q("details").hidden, during, after: q("summary").textContent, note: q("div").textContent,
  noteHidden: q("div").hidden, before, min: node.widgets[0].options.getMinHeight(), height: node.size[1],
  advanced: mod.advancedInputs({ input: { required: { a: ["INT", {}], b: ["INT", { advanced: true }] },
                                          optional: { c: ["STRING", { advanced: true }] } } }) }));
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
    # the answer box keeps ten 16 px lines; the summary line and the note add theirs, and the node grows
    assert got["before"] == 10 * 16 + 32 and got["min"] > got["before"] and got["height"] >= 60 + got["min"]
    assert got["note"] == "The reasoning used all 2 tokens" and got["noteHidden"] is False
    assert got["advanced"] == ["b", "c"]
