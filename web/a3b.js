// comfyui-a3b frontend extension: streamed tokens in A3BGenerate nodes, and a runtime status panel.
//
// The backend sends "a3b.token" ({node, text, n, reset}, or {node, reasoning, n} for a thinking
// model's reasoning) for every generated piece of text and "a3b.done" when a generation ends; the
// reasoning streams into a collapsed box of its own above the answer; GET /a3b/status describes the shared runtime (loaded models,
// memory, the in-process language server).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const STREAM_WIDGET = "a3b_stream";
const REASONING_WIDGET = "a3b_reasoning";
const STATUS_POLL_MS = 3000;

function streamWidget(node) {
  let w = node.widgets?.find((x) => x.name === STREAM_WIDGET);
  if (!w) {
    w = ComfyWidgets.STRING(node, STREAM_WIDGET, ["STRING", { multiline: true }], app).widget;
    w.serialize = false; // display only: never saved in the workflow nor sent with the prompt
    w.options = { ...(w.options || {}), serialize: false };
    if (w.inputEl) {
      w.inputEl.readOnly = true;
      w.inputEl.placeholder = "generated text streams here";
      w.inputEl.classList.add("a3b-stream");
    }
  }
  return w;
}

function setStream(node, text) {
  const w = streamWidget(node);
  w.value = text;
  if (w.inputEl) {
    w.inputEl.value = text;
    w.inputEl.scrollTop = w.inputEl.scrollHeight;
  }
  node.setDirtyCanvas?.(true, false);
}

// The reasoning box's summary line: collapsed, it still says how much the model reasoned.
export function reasoningSummary(text, done) {
  const words = text.trim() ? text.trim().split(/\s+/).length : 0;
  return `${done ? "Reasoning" : "Reasoning\u2026"} (${words} word${words === 1 ? "" : "s"})`;
}

function reasoningBox(node) {
  if (node.__a3bReasoningBox) return node.__a3bReasoningBox;
  if (typeof node.addDOMWidget !== "function") return null; // older frontends: the output socket only
  const box = document.createElement("details");
  box.className = "a3b-reasoning";
  box.innerHTML = "<summary></summary><pre></pre>";
  box.hidden = true;
  const w = node.addDOMWidget(REASONING_WIDGET, "a3b-reasoning", box, { serialize: false, hideOnZoom: false });
  if (w) w.serialize = false;
  node.__a3bReasoningBox = box;
  return box;
}

function setReasoning(node, text, done = false) {
  const box = reasoningBox(node);
  if (!box) return;
  box.hidden = !text;
  box.querySelector("summary").textContent = reasoningSummary(text, done);
  const pre = box.querySelector("pre");
  pre.textContent = text;
  pre.scrollTop = pre.scrollHeight;
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

export function renderStatus(st) {
  const models = st.models || [];
  const lsp = st.lsp;
  const items = models.map((m) => `
      <li title="${escapeHtml(m.path)}"><b>${escapeHtml(m.name)}</b><br>
        ${escapeHtml(m.architecture)} ${escapeHtml(m.file_type ?? "")} &middot; ${fmtBytes(m.weights_bytes)}
        + KV ${fmtBytes(m.kv_bytes)} &middot; n_ctx ${m.spec?.n_ctx} &middot; ${m.busy ? "busy" : "idle"}
        ${placementLine(m.placement) ? `<br><small class="a3b-placement">${placementLine(m.placement)}</small>` : ""}
        ${m.offload ? `<br><small>${escapeHtml(m.offload)}</small>` : ""}</li>`).join("");
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
      <div>llama-cpp-python ${escapeHtml(st.llama_cpp_python)}; loads ${st.weight_loads}, cache hits ${st.cache_hits}, evictions ${st.evictions}</div>
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
  .a3b-models li { border-top: 1px solid #555; padding: 4px 0; overflow-wrap: anywhere; }
  .a3b-status h3 { margin: 0 0 6px 0; }
  .a3b-status button { margin-top: 8px; }
  textarea.a3b-stream { font-family: monospace; }
  details.a3b-reasoning { font-size: 12px; opacity: 0.75; margin: 2px 0; }
  details.a3b-reasoning pre { max-height: 160px; overflow: auto; white-space: pre-wrap; margin: 4px 0; }
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
      if (detail.reset) { node.__a3bText = ""; node.__a3bReasoning = ""; setReasoning(node, ""); }
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
    if (nodeData.name !== "A3BGenerate") return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const r = onNodeCreated?.apply(this, arguments);
      streamWidget(this);
      return r;
    };
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = message?.text?.[0];
      if (typeof text === "string") { this.__a3bText = text; setStream(this, text); }
    };
  },
});
