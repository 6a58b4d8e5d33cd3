"""The web extension in a real browser: headless Chromium against a live ComfyUI (COMFYUI_DIR).

Needs Debian's chromium and chromium-driver and the selenium package. Screenshots go to
$A3B_SCREENSHOTS (default: the test's temporary folder) so a person can look at them.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from test_comfyui_live import COMFYUI_DIR, EXAMPLES, ComfyServer

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")

pytestmark = [pytest.mark.comfyui, pytest.mark.slow,
              pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from comfyui_a3b.bench.common import free_port

    s = ComfyServer(tmp_path_factory.mktemp("comfyui-web"), env={"A3B_LSP": f"tcp:127.0.0.1:{free_port()}"})
    # a fresh user folder would greet the browser with the template picker over the canvas
    settings = s.workdir / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    d = Path(os.environ.get("A3B_SCREENSHOTS") or tmp_path_factory.mktemp("shots"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def browser(server):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("apt-get install chromium chromium-driver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--window-size=1600,1000"):
        opts.add_argument(flag)
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    drv.set_script_timeout(120)
    try:
        drv.get(server.base + "/")
        wait_for(drv, "return !!(window.comfyAPI && window.comfyAPI.app && window.comfyAPI.app.app.graph"
                      " && window.comfyAPI.app.app.extensions.some(e => e.name === 'comfyui-a3b')"
                      " && window.LiteGraph && window.LiteGraph.registered_node_types['A3BGenerate'])", 90)
        yield drv
    finally:
        drv.quit()


def wait_for(drv, script: str, timeout: float = 60, every: float = 0.1, args: tuple = ()):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = drv.execute_script(script, *args)
        if v:
            return v
        time.sleep(every)
    raise TimeoutError(script)


def run_async(drv, body: str, *args):
    """Run `body` (may use await, `app`, `args`) in the page and return its value."""
    return drv.execute_async_script(
        "const done = arguments[arguments.length - 1]; const args = Array.from(arguments).slice(0, -1);"
        "const app = window.comfyAPI.app.app;"
        f"(async () => {{ {body} }})().then(done, e => done({{error: String(e && e.stack || e)}}));", *args)


STREAM_TEXT = ("const n = app.graph.getNodeById(Number(arguments[0]));"
               "const w = n && n.widgets.find(w => w.name === 'a3b_stream'); return w ? w.value : null;")


def test_examples_load_in_the_editor_and_match_their_api_form(browser):
    for name in ("rag", "comic_script"):
        wf = json.loads((EXAMPLES / f"{name}.json").read_text())
        out = run_async(browser, "await app.loadGraphData(args[0]); const p = await app.graphToPrompt();"
                                 "return p.output;", wf)
        assert "error" not in out, out
        api = json.loads((EXAMPLES / f"{name}.api.json").read_text())
        assert set(out) == set(api)
        for nid, node in api.items():
            assert out[nid]["class_type"] == node["class_type"]
            if node["class_type"].startswith("A3B"):
                assert out[nid]["inputs"] == node["inputs"], (name, nid)
            else:  # core nodes may carry display-only widgets (PreviewAny's "preview")
                assert {k: out[nid]["inputs"].get(k) for k in node["inputs"]} == node["inputs"], (name, nid)


#: each node as the editor has laid it out after loading a workflow: its size, the size its widgets
#: need (LiteGraph's computeSize), and its box on the canvas with the title bar
LAYOUT = """
  await app.loadGraphData(args[0]);
  const T = LiteGraph.NODE_TITLE_HEIGHT;
  return app.graph._nodes.map(n => ({id: n.id, type: n.type, size: [n.size[0], n.size[1]],
    need: Array.from(n.computeSize()), box: [n.pos[0], n.pos[1] - T, n.pos[0] + n.size[0], n.pos[1] + n.size[1]]}));
"""


def test_examples_open_with_every_widget_shown_and_nothing_covered(browser, shots):
    for name in ("rag", "comic_script"):
        wf = json.loads((EXAMPLES / f"{name}.json").read_text())
        nodes = run_async(browser, LAYOUT, wf)
        assert "error" not in nodes, nodes
        browser.save_screenshot(str(shots / f"example_{name}.png"))
        saved = {n["id"]: n["size"] for n in wf["nodes"]}
        for n in nodes:
            assert n["size"] == saved[n["id"]], (name, n)          # opened as saved, not enlarged
            assert n["size"][0] >= n["need"][0] and n["size"][1] >= n["need"][1], (name, n)
        for i, a in enumerate(nodes):
            for b in nodes[i + 1:]:
                (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = a["box"], b["box"]
                assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, (name, a, b)


def test_tokens_stream_into_the_node_and_status_panel(browser, server, shots):
    # a small graph built in the page: loader -> generate, queued by the browser (its own client id)
    body = """
      app.graph.clear();
      const L = LiteGraph.createNode('A3BLoader'); app.graph.add(L); L.pos = [40, 60];
      const G = LiteGraph.createNode('A3BGenerate'); app.graph.add(G); G.pos = [420, 60]; G.size = [420, 640];
      L.connect(0, G, 0);
      G.widgets.find(w => w.name === 'prompt').value = 'Write a short poem about the sea, in four lines.';
      G.widgets.find(w => w.name === 'max_new_tokens').value = 96;
      G.widgets.find(w => w.name === 'seed').value = 31;
      await app.queuePrompt(0, 1);
      return G.id;"""
    gid = run_async(browser, body)
    assert not isinstance(gid, dict), gid
    seen: list[int] = []
    shot_mid = None
    deadline = time.time() + 120
    while time.time() < deadline:
        text = browser.execute_script(STREAM_TEXT, gid) or ""
        if not seen or len(text) != seen[-1]:
            seen.append(len(text))
        if shot_mid is None and len(text) > 20:
            shot_mid = shots / "a3b_streaming.png"
            browser.save_screenshot(str(shot_mid))
        hist = server.get("/history")
        if hist and any(h["status"].get("status_str") == "success" for h in hist.values()):
            break
        time.sleep(0.05)
    final = next(iter(server.get("/history").values()))["outputs"][str(gid)]["text"][0]
    time.sleep(0.3)
    shown = browser.execute_script(STREAM_TEXT, gid)
    browser.save_screenshot(str(shots / "a3b_generated.png"))
    assert shown == final
    growth = [n for n in seen if 0 < n < len(final)]
    assert len(growth) >= 3, seen  # the text grew while it was generated, not all at once
    # the status panel in the sidebar
    browser.execute_script("window.comfyAPI.app.app.extensionManager.command"
                           ".execute('Workspace.ToggleSidebarTab.a3b-status')")
    panel = wait_for(browser, "const el = document.querySelector('.a3b-status');"
                              "return el && el.innerText.includes('SmolLM2') ? el.innerText : null;", 20)
    browser.save_screenshot(str(shots / "a3b_status_panel.png"))
    lsp = server.get("/a3b/status")["lsp"]
    assert lsp["running"] and f"listening on {lsp['address']}" in panel, panel
    assert "MB" in panel
    # its unload button frees the model
    browser.execute_script("document.querySelector('.a3b-unload').click()")
    wait_for(browser, "const el = document.querySelector('.a3b-status');"
                      "return el && el.innerText.includes('no model loaded');", 20)
    assert server.get("/a3b/status")["models"] == []


def test_interrupt_from_the_browser(browser, server):
    body = """
      app.graph.clear();
      const L = LiteGraph.createNode('A3BLoader'); app.graph.add(L);
      const G = LiteGraph.createNode('A3BGenerate'); app.graph.add(G); G.pos = [420, 60];
      L.connect(0, G, 0);
      G.widgets.find(w => w.name === 'prompt').value = 'Write a very long story about a dragon.';
      G.widgets.find(w => w.name === 'max_new_tokens').value = 1500;
      await app.queuePrompt(0, 1);
      return G.id;"""
    gid = run_async(browser, body)
    wait_for(browser, STREAM_TEXT.replace("return w ? w.value : null;", "return w && w.value.length > 10;"), 60,
             args=(gid,))
    run_async(browser, "await window.comfyAPI.api.api.interrupt(); return true;")
    text = wait_for(browser, STREAM_TEXT.replace("return w ? w.value : null;",
                                                 "return w && w.value.endsWith('[interrupted]') ? w.value : null;"),
                    20, args=(gid,))
    assert len(text) < 3000
