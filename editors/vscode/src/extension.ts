// A3B for VS Code: starts `a3b lsp --stdio` (or connects to a shared `a3b lsp --tcp` server) and lets
// vscode-languageclient wire inline completions, completions, quick fixes and diagnostics to it.
import * as net from "net";
import * as vscode from "vscode";
import {
  ExecuteCommandRequest,
  LanguageClient,
  LanguageClientOptions,
  ServerOptions,
  StreamInfo,
} from "vscode-languageclient/node";

let client: LanguageClient | undefined;
let output: vscode.LogOutputChannel;

const SETTINGS = ["model", "nCtx", "maxTokens", "debounceMs", "fim", "contextTokens", "contextChunks", "warm", "lora"];

// Where the cursor rests, sent as A3B's own `a3b/cursor` notification once it has stayed put for a
// moment: the server reads the prompt a completion there would use, so the first suggestion after
// switching files or moving the cursor is as quick as the ones while typing.
const CURSOR_PAUSE_MS = 250;
let cursorTimer: NodeJS.Timeout | undefined;

function noticeCursor(editor: vscode.TextEditor | undefined): void {
  if (cursorTimer) {
    clearTimeout(cursorTimer);
  }
  if (!editor || !client) {
    return;
  }
  cursorTimer = setTimeout(() => {
    const pos = editor.selection.active;
    client?.sendNotification("a3b/cursor", {
      textDocument: { uri: editor.document.uri.toString() },
      position: { line: pos.line, character: pos.character },
    });
  }, CURSOR_PAUSE_MS);
}

function serverSettings(): Record<string, unknown> {
  const cfg = vscode.workspace.getConfiguration("a3b");
  const out: Record<string, unknown> = {};
  for (const key of SETTINGS) {
    out[key] = cfg.get(key);
  }
  return out;
}

function serverOptions(): ServerOptions {
  const cfg = vscode.workspace.getConfiguration("a3b");
  const address = (cfg.get<string>("server") || "").trim();
  if (address) {
    const i = address.lastIndexOf(":");
    const host = address.slice(0, i).replace(/^\[|\]$/g, "");
    const port = Number(address.slice(i + 1));
    return () =>
      new Promise<StreamInfo>((resolve, reject) => {
        const socket = net.connect({ host, port }, () => resolve({ reader: socket, writer: socket }));
        socket.on("error", reject);
      });
  }
  const command = cfg.get<string>("command") || "a3b";
  return { command, args: ["lsp", "--stdio"] };
}

async function start(context: vscode.ExtensionContext): Promise<void> {
  const cfg = vscode.workspace.getConfiguration("a3b");
  const token = (cfg.get<string>("token") || "").trim();
  const clientOptions: LanguageClientOptions = {
    documentSelector: [{ scheme: "file" }, { scheme: "untitled" }],
    initializationOptions: { ...serverSettings(), ...(token ? { token } : {}) },
    synchronize: { configurationSection: "a3b" },
    outputChannel: output,
  };
  client = new LanguageClient("a3b", "A3B", serverOptions(), clientOptions);
  await client.start();
  context.subscriptions.push(
    client,
    vscode.window.onDidChangeActiveTextEditor((editor) => noticeCursor(editor)),
    vscode.window.onDidChangeTextEditorSelection((e) => noticeCursor(e.textEditor))
  );
  noticeCursor(vscode.window.activeTextEditor);
}

async function serverCommand(command: string, args: unknown[]): Promise<any> {
  if (!client) {
    throw new Error("the A3B language server is not running");
  }
  return client.sendRequest(ExecuteCommandRequest.type, { command, arguments: args });
}

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  output = vscode.window.createOutputChannel("A3B", { log: true });
  context.subscriptions.push(
    vscode.commands.registerCommand("a3b.showStatus", async () => {
      const st = await serverCommand("a3b.status", []);
      output.appendLine(JSON.stringify(st, null, 2));
      output.show(true);
      const lat = st.server.latency_ms_single_line;
      vscode.window.showInformationMessage(
        `A3B: ${st.model ?? "no model"}, cache hit rate ${(100 * st.server.cache.hit_rate).toFixed(0)}%, ` +
          `single-line p50 ${lat.p50?.toFixed(0) ?? "-"} ms, p95 ${lat.p95?.toFixed(0) ?? "-"} ms`
      );
    }),
    vscode.commands.registerCommand("a3b.explain", async () => {
      const editor = vscode.window.activeTextEditor;
      if (!editor || editor.selection.isEmpty) {
        vscode.window.showWarningMessage("A3B: select some code to explain.");
        return;
      }
      const s = editor.selection;
      const range = {
        start: { line: s.start.line, character: s.start.character },
        end: { line: s.end.line, character: s.end.character },
      };
      const res = await vscode.window.withProgress(
        { location: vscode.ProgressLocation.Notification, title: "A3B is reading the selection…", cancellable: false },
        () => serverCommand("a3b.explainSelection", [editor.document.uri.toString(), range])
      );
      output.appendLine(res.explanation);
      output.show(true);
    }),
    vscode.commands.registerCommand("a3b.fixTracebackFromClipboard", async () => {
      const text = await vscode.env.clipboard.readText();
      const res = await serverCommand("a3b.fixTraceback", [text]);
      if (!res.applied) {
        vscode.window.showWarningMessage("A3B: the fix was not applied.");
      }
    }),
    vscode.commands.registerCommand("a3b.restart", async () => {
      if (client) {
        await client.stop();
      }
      await start(context);
    })
  );
  await start(context);
}

export async function deactivate(): Promise<void> {
  if (client) {
    await client.stop();
  }
}
