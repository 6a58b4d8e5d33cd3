// comfyui-a3b frontend extension: streamed tokens in A3BGenerate nodes, and a runtime status panel.
//
// The backend sends "a3b.token" ({node, text, n, reset}, or {node, reasoning, n} for a thinking
// model's reasoning) for every generated piece of text and "a3b.done" when a generation ends. Inside
// the node, the reasoning streams into a collapsed box of its own above the answer, and the answer box
// takes the node's free height; GET /a3b/status describes the shared runtime (loaded models, memory,
// the in-process language server) in the A3B sidebar tab.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const OUTPUT_WIDGET = "a3b_stream"; // one widget: the reasoning box above the answer, and a note
const STATUS_POLL_MS = 3000;
//: the answer box shows at least this many lines, and takes whatever height the node has beyond that
export const ANSWER_MIN_LINES = 10;
export const LINE_PX = 16;
const SUMMARY_PX = 24;
const REASONING_OPEN_PX = 168;
const NOTE_PX = 40;
//: the most height A3B Generate's input text boxes take: the answer gets the rest of the node
export const INPUT_BOX_MAX = { prompt: 140, system: 90, stop: 50, json_schema: 110 };

// The smallest height the output widget needs: ten lines of answer, the reasoning's summary line (and
// its open box), the note when there is one.
export function outputMinHeight(state) {
  let h = ANSWER_MIN_LINES * LINE_PX + 32;   // + the textarea's padding and border, the widget's margins
  if (state.reasoningShown) h += SUMMARY_PX + (state.reasoningOpen ? REASONING_OPEN_PX : 0);
  if (state.noteShown) h += NOTE_PX;
  return h;
}

function grow(node) {
  // the node keeps its size unless its content needs more (a box opened, a note added)
  const need = node.computeSize?.();
  if (need && (need[1] > node.size[1] || need[0] > node.size[0])) {
    node.setSize?.([Math.max(node.size[0], need[0]), Math.max(node.size[1], need[1])]);
  }
  node.setDirtyCanvas?.(true, true);
}

function output(node) {
  if (node.__a3bOut) return node.__a3bOut;
  if (typeof node.addDOMWidget !== "function") return null; // very old frontends: the outputs only
  const box = document.createElement("div");
  box.className = "a3b-output";
  box.innerHTML = '<details class="a3b-reasoning" hidden><summary></summary><pre></pre></details>'
    + '<div class="a3b-note" hidden></div>'
    + '<textarea class="a3b-stream" readonly placeholder="generated text streams here"></textarea>';
  const out = {
    box, reasoning: box.querySelector("details"), summary: box.querySelector("summary"),
    pre: box.querySelector("pre"), note: box.querySelector("div"), answer: box.querySelector("textarea"),
  };
  const state = () => ({ reasoningShown: !out.reasoning.hidden, reasoningOpen: !!out.reasoning.open,
    noteShown: !out.note.hidden });
  const w = node.addDOMWidget(OUTPUT_WIDGET, "a3b-output", box, {
    serialize: false, hideOnZoom: false,
    getValue: () => out.answer.value,
    setValue: (v) => { out.answer.value = v ?? ""; },
    getMinHeight: () => outputMinHeight(state()),
  });
  if (w) { w.serialize = false; w.inputEl = out.answer; }
  out.widget = w;
  out.reasoning.addEventListener?.("toggle", () => grow(node));
  node.__a3bOut = out;
  return out;
}

function setStream(node, text) {
  const out = output(node);
  if (!out) return;
  out.answer.value = text;
  out.answer.scrollTop = out.answer.scrollHeight;
  node.setDirtyCanvas?.(true, false);
}

function setNote(node, note) {
  const out = output(node);
  if (!out) return;
  const shown = !out.note.hidden;
  out.note.hidden = !note;
  out.note.textContent = note || "";
  if (shown !== !!note) grow(node);
}

// The reasoning box's summary line: collapsed, it still says how much the model reasoned.
export function reasoningSummary(text, done) {
  const words = text.trim() ? text.trim().split(/\s+/).length : 0;
  return `${done ? "Reasoning" : "Reasoning\u2026"} (${words} word${words === 1 ? "" : "s"})`;
}

function setReasoning(node, text, done = false) {
  const out = output(node);
  if (!out) return;
  const shown = !out.reasoning.hidden;
  out.reasoning.hidden = !text;
  out.summary.textContent = reasoningSummary(text, done);
  out.pre.textContent = text;
  out.pre.scrollTop = out.pre.scrollHeight;
  if (shown !== !!text) grow(node);
  node.setDirtyCanvas?.(true, false);
}

function nodeById(id) {
  return app.graph?.getNodeById?.(Number(id)) ?? app.graph?.getNodeById?.(id);
}

function fmtBytes(n) {
  if (n == null) return "?";
  const mb = n / (1024 * 1024);
  return mb >= 1024 ? `${(mb / 1024).toFixed(2)} GB` : `${mb.toFixed(0)} MB`;
}

function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// The placement of a model: what went where, device memory expected against measured after the load.
export function placementLine(p) {
  if (!p || !p.gpu) return "";
  const m = p.measured || {};
  const moved = p.n_cpu_moe ? `, ${p.moe ? "experts" : "FFN tensors"} of ${p.n_cpu_moe}/${p.n_layer} layers in RAM` : "";
  const measured = m.gpu_bytes != null ? `, measured ${fmtBytes(m.gpu_bytes)}` : "";
  return `placement: ${Math.min(p.n_gpu_layers, p.n_layer)}/${p.n_layer} layers on the GPU${moved} (${escapeHtml(p.speed)});`
    + ` VRAM expected ${fmtBytes(p.gpu_bytes)}${measured}; RAM ${fmtBytes(p.host_bytes)}`;
}

function baseName(p) {
  return String(p).split(/[\\/]/).pop();
}

// Models loaded from one file (one line each in the store: one per context setting) as one entry with
// a line per context, in the order they were loaded.
export function groupModels(models) {
  const groups = new Map();
  for (const m of models) {
    const key = `${m.path}\u0000${m.served_file ?? ""}\u0000${m.features?.projector ?? ""}`;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(m);
  }
  return [...groups.values()];
}

export function renderStatus(st) {
  const models = st.models || [];
  const lsp = st.lsp;
  const items = groupModels(models).map((g) => {
    const m = g[0];
    const projector = m.features?.projector;
    const contexts = g.map((c) => `<li class="a3b-context">n_ctx ${escapeHtml(c.spec?.n_ctx)} &middot; KV ${fmtBytes(c.kv_bytes)}`
      + ` &middot; ${c.busy ? "busy" : "idle"}${c.spec?.lora_path ? ` &middot; LoRA ${escapeHtml(baseName(c.spec.lora_path))}` : ""}</li>`).join("");
    return `
      <li title="${escapeHtml(m.path)}"><b>${escapeHtml(m.name)}</b><br>
        ${escapeHtml(m.architecture)} ${escapeHtml(m.file_type ?? "")} &middot; ${fmtBytes(m.weights_bytes)}
        ${projector ? `<br><span class="a3b-projector">projector: ${escapeHtml(projector)}</span>` : ""}
        <ul class="a3b-contexts">${contexts}</ul>
        ${placementLine(m.placement) ? `<small class="a3b-placement">${placementLine(m.placement)}</small>` : ""}
        ${m.offload ? `<br><small>${escapeHtml(m.offload)}</small>` : ""}</li>`;
  }).join("");
  const vram = st.vram;
  const vramLine = vram && !vram.error
    ? `VRAM policy: <b>${escapeHtml(vram.policy)}</b> (A3B_VRAM_POLICY)`
      + (vram.managed && vram.managed.length ? `, ${vram.managed.length} model(s) in ComfyUI's model management` : "")
      + (vram.managed || []).flatMap((e) => e.handovers || []).slice(-1).map((h) =>
        `; last hand-over: ${fmtBytes(h.before_bytes - h.gpu_bytes)} given back by a smaller placement in ${h.seconds.toFixed(1)} s`).join("")
    : "";
  let lspLine = "in-process language server: off";
  if (lsp && !lsp.error && lsp.running !== false) {
    const addr = lsp.address || [lsp.host, lsp.port].filter((x) => x != null).join(":") || lsp.url || "";
    const clients = Array.isArray(lsp.clients) ? lsp.clients.length : lsp.clients;
    lspLine = "in-process language server: listening"
      + (addr ? ` on <code>${escapeHtml(String(addr))}</code>` : "")
      + (clients != null ? `, ${escapeHtml(String(clients))} client(s)` : "");
  } else if (lsp && lsp.error) {
    lspLine = `in-process language server: error: ${escapeHtml(lsp.error)}`;
  }
  const srv = st.serve;
  let serveLine = "OpenAI-compatible server: off (A3B_SERVE)";
  if (srv && !srv.error) {
    serveLine = `OpenAI-compatible server: <code>${escapeHtml(String(srv.url))}</code>`
      + ` serving ${escapeHtml(String(srv.model))}${srv.token ? ", token required" : ""}`
      + `, ${escapeHtml(String(srv.requests))} request(s)`;
  } else if (srv && srv.error) {
    serveLine = `OpenAI-compatible server: error: ${escapeHtml(srv.error)}`;
  }
  return `
    <div class="a3b-status">
      <h3>A3B runtime</h3>
      <div>process memory (RSS): <b>${fmtBytes(st.rss_bytes)}</b>; models: <b>${fmtBytes(st.memory_bytes)}</b>
        ${st.budget_bytes ? ` of ${fmtBytes(st.budget_bytes)} budget` : ""}</div>
      <div>llama-cpp-python ${escapeHtml(st.llama_cpp_python)}${st.llama_cpp_error ? ` (<b>cannot be imported</b>: ${escapeHtml(st.llama_cpp_error)})` : ""}; loads ${st.weight_loads}, cache hits ${st.cache_hits}, evictions ${st.evictions}</div>
      <div class="a3b-lsp">${lspLine}</div>
      <div class="a3b-serve">${serveLine}</div>
      ${vramLine ? `<div class="a3b-vram">${vramLine}</div>` : ""}
      ${models.length ? `<ul class="a3b-models">${items}</ul>` : "<div><i>no model loaded</i></div>"}
      <button class="a3b-unload">Unload A3B models</button>
    </div>`;
}

async function fetchStatus() {
  const r = await api.fetchApi("/a3b/status");
  if (!r.ok) throw new Error(`HTTP ${r.status}`);
  return r.json();
}

function mountStatus(el) {
  el.classList.add("a3b-panel");
  let timer = null;
  const refresh = async () => {
    try {
      el.innerHTML = renderStatus(await fetchStatus());
      el.querySelector(".a3b-unload")?.addEventListener("click", async () => {
        await api.fetchApi("/a3b/unload", { method: "POST" });
        refresh();
      });
    } catch (e) {
      el.innerHTML = `<div class="a3b-status">A3B status unavailable: ${escapeHtml(e.message)}</div>`;
    }
  };
  refresh();
  timer = setInterval(() => { if (el.isConnected) refresh(); else clearInterval(timer); }, STATUS_POLL_MS);
  return () => clearInterval(timer);
}

const STYLE = `
  .a3b-panel { padding: 8px; font-size: 13px; }
  .a3b-status > div { margin-bottom: 4px; }
  .a3b-models { list-style: none; padding: 0; margin: 8px 0 0 0; }
  .a3b-models > li { border-top: 1px solid #555; padding: 4px 0; overflow-wrap: anywhere; }
  .a3b-contexts { list-style: none; padding: 0 0 0 12px; margin: 2px 0; }
  .a3b-status h3 { margin: 0 0 6px 0; }
  .a3b-status button { margin-top: 8px; }
  .a3b-output { display: flex; flex-direction: column; box-sizing: border-box; height: 100%; width: 100%;
    overflow: hidden; gap: 2px; }
  .a3b-output textarea.a3b-stream { flex: 1 1 auto; min-height: 0; width: 100%; box-sizing: border-box; resize: none;
    font-family: monospace; font-size: 12px; line-height: ${LINE_PX}px; padding: 4px;
    background: var(--comfy-input-bg, #222); color: var(--input-text, #ddd); border: 1px solid var(--border-color, #444);
    border-radius: 4px; }
  .a3b-output details.a3b-reasoning { flex: 0 0 auto; font-size: 12px; opacity: 0.8; max-width: 100%;
    color: var(--input-text, #ddd); }
  .a3b-output details.a3b-reasoning summary { cursor: pointer; height: ${SUMMARY_PX - 4}px; line-height: ${SUMMARY_PX - 4}px; }
  .a3b-output details.a3b-reasoning pre { height: ${REASONING_OPEN_PX - 8}px; overflow: auto; white-space: pre-wrap;
    overflow-wrap: anywhere; margin: 2px 0; box-sizing: border-box; max-width: 100%; }
  .a3b-output .a3b-note { flex: 0 0 auto; font-size: 12px; line-height: 16px; color: #f0b050; overflow: auto;
    max-height: ${NOTE_PX - 4}px; }
`;

app.registerExtension({
  name: "comfyui-a3b",

  async setup() {
    const style = document.createElement("style");
    style.textContent = STYLE;
    document.head.appendChild(style);

    api.addEventListener("a3b.token", ({ detail }) => {
      const node = nodeById(detail.node);
      if (!node) return;
      if (detail.reset) { node.__a3bText = ""; node.__a3bReasoning = ""; setReasoning(node, ""); setNote(node, ""); }
      if (detail.reasoning) {
        node.__a3bReasoning = (node.__a3bReasoning || "") + detail.reasoning;
        setReasoning(node, node.__a3bReasoning);
      }
      if (detail.text === undefined) return;
      node.__a3bText = (node.__a3bText || "") + (detail.text || "");
      setStream(node, node.__a3bText);
    });
    api.addEventListener("a3b.done", ({ detail }) => {
      const node = nodeById(detail.node);
      if (!node) return;
      if (node.__a3bReasoning) setReasoning(node, node.__a3bReasoning, true);
      if (detail.note || detail.route) setNote(node, [detail.route, detail.note].filter(Boolean).join("\n"));
      if (detail.interrupted) setStream(node, (node.__a3bText || "") + "\n[interrupted]");
    });

    const manager = app.extensionManager;
    if (manager?.registerSidebarTab) {
      manager.registerSidebarTab({
        id: "a3b-status",
        icon: "pi pi-microchip",
        title: "A3B",
        tooltip: "A3B runtime: loaded models, memory, language server",
        type: "custom",
        render: (el) => { el.__a3bStop?.(); el.__a3bStop = mountStatus(el); },
        destroy: () => {},
      });
    } else {
      // Older frontends: a small floating panel.
      const el = document.createElement("div");
      el.style.cssText = "position:fixed;right:8px;bottom:8px;z-index:1000;background:#222;color:#ddd;max-width:420px;";
      document.body.appendChild(el);
      mountStatus(el);
    }
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    const advanced = advancedInputs(nodeData);
    if (advanced.length) {
      // inputs declared advanced: hidden until the node's "Show Advanced" (right-click menu)
      const created = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const r = created?.apply(this, arguments);
        for (const w of this.widgets || []) if (advanced.includes(w.name)) markAdvanced(this, w);
        const need = this.computeSize?.();
        if (need) this.setSize?.([Math.max(this.size[0], need[0]), need[1]]);
        return r;
      };
    }
    if (nodeData.name !== "A3BGenerate") return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const r = onNodeCreated?.apply(this, arguments);
      for (const w of this.widgets || []) {
        const most = INPUT_BOX_MAX[w.name];
        if (most && w.options) w.options.getMaxHeight = () => most;
      }
      output(this);
      grow(this); // a node added from the menu opens large enough for all its widgets
      return r;
    };
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = message?.text?.[0];
      if (typeof text === "string") { this.__a3bText = text; setStream(this, text); }
      // the route an A3B Router handle took, and what to tell the user (an answer the reasoning ate)
      setNote(this, [message?.route?.[0], message?.note?.[0]].filter(Boolean).join("\n"));
    };
  },
});

// Hide an advanced widget until the node's "Show Advanced". The frontend (1.27) leaves hidden widgets
// out of drawing and of the node's size, but still lays out a row for each: a hidden one is given no
// height, so the node has no empty band where they are.
export function markAdvanced(node, w) {
  w.advanced = true;
  if (w.computeLayoutSize) { // a text box (DOM widget)
    const own = w.computeLayoutSize.bind(w);
    w.computeLayoutSize = (n) => (node.showAdvanced ? own(n) : { minHeight: 0, maxHeight: 0, minWidth: 0 });
  } else {
    const own = w.computeSize?.bind(w);
    w.computeSize = (width) => {
      if (!node.showAdvanced) return [0, -4]; // the layout adds 4 between rows
      return own ? own(width) : [width ?? 0, globalThis.LiteGraph?.NODE_WIDGET_HEIGHT ?? 20];
    };
  }
}

// The names of a node's inputs marked advanced in its definition (/object_info).
export function advancedInputs(nodeData) {
  const out = [];
  for (const section of ["required", "optional"]) {
    for (const [name, spec] of Object.entries(nodeData?.input?.[section] || {})) {
      if (Array.isArray(spec) && spec[1] && spec[1].advanced) out.push(name);
    }
  }
  return out;
}
