"""The web extension in a real browser: headless Chromium against a live ComfyUI (COMFYUI_DIR).

Needs Debian's chromium and chromium-driver and the selenium package. Screenshots go to
$A3B_SCREENSHOTS (default: the test's temporary folder) so a person can look at them.
"""
from __future__ import annotations

import json
import os
import time
import urllib.request
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
                 "--disable-component-update", "--no-first-run", "--window-size=1600,900"):
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
        api = json.loads((EXAMPLES / "api" / f"{name}.api.json").read_text())
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


EXAMPLE_NAMES = ("rag", "comic_script", "storyboard_json", "image_dialogue")

#: the canvas and the minimap on the page, and each node's box (title bar included) on the page after
#: the saved view is restored
ON_SCREEN = """
  const c = app.canvas, r = c.canvas.getBoundingClientRect(), s = c.ds.scale, [ox, oy] = c.ds.offset;
  const T = LiteGraph.NODE_TITLE_HEIGHT;
  const mm = document.querySelector('.minimap-main-container');
  const m = mm && mm.offsetParent ? mm.getBoundingClientRect() : null;
  const box = (x0, y0, x1, y1) => [r.left + (x0 + ox) * s, r.top + (y0 + oy) * s, r.left + (x1 + ox) * s,
                                   r.top + (y1 + oy) * s];
  return {canvas: [r.left, r.top, r.right, r.bottom], minimap: m && [m.left, m.top, m.right, m.bottom],
          menu: document.querySelector('.comfyui-body-top')?.getBoundingClientRect().bottom ?? 0,
          nodes: app.graph._nodes.map(n => ({id: n.id, title: n.title,
            box: box(n.pos[0], n.pos[1] - T, n.pos[0] + n.size[0], n.pos[1] + n.size[1])}))};
"""


def _apart(a, b) -> bool:
    return a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]


def _thumbnail(browser, canvas, path: Path) -> None:
    """The Templates browser's thumbnail of an opened example (A3B_THUMBNAILS=examples/ writes them):
    the canvas without the minimap and LiteGraph's info corner, 640 px wide."""
    import io

    from PIL import Image

    hide = ("const m = document.querySelector('.minimap-main-container'); if (m) m.style.visibility = arguments[0];"
            "const c = window.comfyAPI.app.app.canvas; c.show_info = arguments[0] !== 'hidden'; c.draw(true, true);")
    browser.execute_script(hide, "hidden")
    time.sleep(0.3)
    shot = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
    browser.execute_script(hide, "visible")
    ratio = shot.width / browser.execute_script("return window.innerWidth")
    img = shot.crop(tuple(round(v * ratio) for v in canvas))
    img.resize((640, round(640 * img.height / img.width))).save(path, quality=85)


def test_examples_open_framed_with_every_node_in_view(browser, shots):
    """Each example opens with every node (title bar included) inside the canvas of a 1600 x 900 window:
    below the menu bar, beside the sidebar, clear of the minimap; at least as large as its widgets need,
    and no node over another."""
    assert browser.execute_script("return [window.outerWidth, window.outerHeight]") == [1600, 900]
    for name in EXAMPLE_NAMES:
        wf = json.loads((EXAMPLES / f"{name}.json").read_text())
        nodes = run_async(browser, LAYOUT, wf)
        assert "error" not in nodes, nodes
        time.sleep(0.5)
        browser.save_screenshot(str(shots / f"example_{name}.png"))
        saved = {n["id"]: n["size"] for n in wf["nodes"]}
        for n in nodes:
            assert n["size"] == saved[n["id"]], (name, n)          # opened as saved, not enlarged
            assert n["size"][0] >= n["need"][0] and n["size"][1] >= n["need"][1], (name, n)
        for i, a in enumerate(nodes):
            for b in nodes[i + 1:]:
                assert _apart(a["box"], b["box"]), (name, a, b)
        view = browser.execute_script("const app = window.comfyAPI.app.app;" + ON_SCREEN)
        if os.environ.get("A3B_THUMBNAILS"):
            _thumbnail(browser, view["canvas"], Path(os.environ["A3B_THUMBNAILS"]) / f"{name}.jpg")
        cx0, cy0, cx1, cy1 = view["canvas"]
        assert cy0 >= view["menu"]
        for n in view["nodes"]:
            x0, y0, x1, y1 = n["box"]
            assert cx0 <= x0 and cy0 <= y0 and x1 <= cx1 and y1 <= cy1, (name, n, view["canvas"])
            if view["minimap"]:
                assert _apart(n["box"], view["minimap"]), (name, n, view["minimap"])


def test_the_templates_browser_lists_each_example_once_with_its_thumbnail_and_opens_it(browser, server, shots):
    """ComfyUI lists every .json of examples/ as a template of the pack: the four workflows, each with its
    thumbnail, and no API-format file; a click on each tile opens its workflow without an error."""
    listed = server.get("/workflow_templates")["comfyui-a3b"]
    assert sorted(listed) == sorted(EXAMPLE_NAMES)
    for name in EXAMPLE_NAMES:
        with urllib.request.urlopen(f"{server.base}/api/workflow_templates/comfyui-a3b/{name}.jpg", timeout=30) as r:
            assert r.headers["Content-Type"] == "image/jpeg" and len(r.read()) > 1000
    cmd = "window.comfyAPI.app.app.extensionManager.command.execute('Comfy.BrowseTemplates')"
    pick = """
      const opt = Array.from(document.querySelectorAll('.p-listbox-option'))
        .find(e => e.innerText.trim() === 'comfyui-a3b');
      if (!opt) return null; opt.click(); return true;"""
    # a tile's thumbnail loads while the tile is in view (the frontend frees those scrolled away, and the
    # fourth is below the dialog's fold): each tile is scrolled to in turn until its thumbnail was seen
    cards = """
      const all = Array.from(document.querySelectorAll('[data-testid^="template-workflow-"]'));
      const seen = arguments[0];
      const next = all.find(c => !seen.includes(c.getAttribute('data-testid').slice('template-workflow-'.length)));
      const state = all.map(c => ({
        id: c.getAttribute('data-testid').slice('template-workflow-'.length),
        loaded: Array.from(c.querySelectorAll('img')).some(i => i.complete && i.naturalWidth > 0)}));
      if (next) next.scrollIntoView({block: 'nearest'});
      return state;"""
    for k, name in enumerate(EXAMPLE_NAMES):
        browser.execute_script(cmd)
        wait_for(browser, pick, 30)
        seen: list[str] = []
        deadline = time.time() + 30
        picked = time.time()
        while sorted(seen) != sorted(EXAMPLE_NAMES) and time.time() < deadline:
            shown = browser.execute_script(cards, seen)
            if sorted(c["id"] for c in shown) == sorted(EXAMPLE_NAMES):   # the pack's tiles, not the last list's
                seen += [c["id"] for c in shown if c["loaded"] and c["id"] not in seen]
            elif time.time() - picked > 3:    # a click while the dialog was still opening can be lost on a
                browser.execute_script(pick)  # busy machine: the pack's entry is clicked again
                picked = time.time()
            time.sleep(0.2)
        assert sorted(c["id"] for c in shown) == sorted(EXAMPLE_NAMES), shown
        assert sorted(seen) == sorted(EXAMPLE_NAMES), (seen, shown)   # every tile showed its thumbnail
        if k == 0:
            browser.save_screenshot(str(shots / "templates.png"))
        browser.execute_script(f"document.querySelector('[data-testid=\"template-workflow-{name}\"]').click()")
        want = len(json.loads((EXAMPLES / f"{name}.json").read_text())["nodes"])
        wait_for(browser, "return !document.querySelector('[data-testid=\"template-workflows-content\"]')"
                          f" && window.comfyAPI.app.app.graph._nodes.length === {want}", 30)
        errors = browser.execute_script(
            "return Array.from(document.querySelectorAll('.p-dialog, .p-toast-message')).map(e => e.innerText)")
        assert not [e for e in errors if "rror" in e], (name, errors)


#: a node's box on the page, and a DOM element's
PAGE_BOX = """
  const pageBox = (n) => { const c = app.canvas, r = c.canvas.getBoundingClientRect(), s = c.ds.scale;
    const [ox, oy] = c.ds.offset;
    return [r.left + (n.pos[0] + ox) * s, r.top + (n.pos[1] + oy) * s, r.left + (n.pos[0] + n.size[0] + ox) * s,
            r.top + (n.pos[1] + n.size[1] + oy) * s]; };
  const elBox = (e) => { const b = e.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; };
  const frame = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const redraw = async () => { app.canvas.setDirty(true, true); app.canvas.draw(true, true); await frame();
    app.canvas.draw(true, true); await frame(); };
  const lines = (ta) => ta.clientHeight / parseFloat(getComputedStyle(ta).lineHeight);
"""


def test_a_generate_node_reads_well_reasoning_above_a_ten_line_answer_that_grows(browser, shots):
    """A fresh A3B Generate node opens large enough for its widgets, with an answer box of at least ten
    lines that takes the height the node is given; a thinking model's reasoning streams into a box above
    the answer, inside the node, and a run whose reasoning took every token says so."""
    body = PAGE_BOX + """
      app.graph.clear(); app.canvas.ds.scale = 1; app.canvas.ds.offset = [0, 0];
      const G = LiteGraph.createNode('A3BGenerate'); app.graph.add(G); G.pos = [80, 60];
      await redraw();
      const out = G.widgets.find(w => w.name === 'a3b_stream'), ta = out.inputEl, box = ta.parentElement;
      const fresh = {size: Array.from(G.size), need: Array.from(G.computeSize()), lines: lines(ta)};
      const api = window.comfyAPI.api.api, send = (t, d) => api.dispatchCustomEvent(t, {node: G.id, ...d});
      send('a3b.token', {text: '', reset: true});
      send('a3b.token', {reasoning: 'The storyboard needs three panels. '.repeat(40), n: 1});
      send('a3b.token', {text: 'Panel 1: Bolt on the rocks.', n: 2});
      send('a3b.done', {n_tokens: 2});
      await redraw();
      const details = box.querySelector('details');
      const closed = {node: pageBox(G), details: elBox(details), answer: elBox(ta), lines: lines(ta)};
      details.open = true; await redraw(); await redraw();
      const opened = {node: pageBox(G), details: elBox(details), pre: elBox(details.querySelector('pre')),
                      answer: elBox(ta), lines: lines(ta)};
      const h0 = ta.clientHeight; G.setSize([G.size[0], G.size[1] + 600]); await redraw();
      const grown = ta.clientHeight - h0;
      send('a3b.done', {n_tokens: 600, note: 'The reasoning used all 600 tokens and no answer came'});
      await redraw();
      const note = box.querySelector('.a3b-note');
      return {fresh, closed, opened, grown, node: pageBox(G), note: [note.hidden, note.innerText, elBox(note)],
              answer: elBox(ta)};"""
    got = run_async(browser, body)
    assert "error" not in got, got
    browser.save_screenshot(str(shots / "a3b_generate_output.png"))
    fresh = got["fresh"]
    assert fresh["size"][1] >= fresh["need"][1] and fresh["size"][0] >= fresh["need"][0], fresh
    assert fresh["lines"] >= 10, fresh
    for state in ("closed", "opened"):
        v = got[state]
        nx0, ny0, nx1, ny1 = v["node"]
        assert v["details"][3] <= v["answer"][1], (state, v)            # the reasoning above the answer
        for part in ("details", "answer") + (("pre",) if state == "opened" else ()):
            x0, y0, x1, y1 = v[part]
            assert nx0 <= x0 and x1 <= nx1 + 1 and ny0 <= y0 and y1 <= ny1 + 1, (state, part, v)
        assert v["lines"] >= 10, (state, v)
    # the answer takes the new height, beyond what the prompt and system boxes take up to their caps
    # (web/a3b.js INPUT_BOX_MAX: 140 and 90 px, from 50 each)
    assert got["grown"] >= 600 - (140 - 50) - (90 - 50) - 10, got
    hidden, text, nbox = got["note"]
    assert not hidden and "used all 600 tokens" in text and nbox[3] <= got["answer"][1] + 1
    assert got["answer"][3] <= got["node"][3] + 1


def test_the_loader_shows_what_loading_needs_and_n_ctx_takes_powers_of_two(browser):
    body = PAGE_BOX + """
      app.graph.clear();
      const L = LiteGraph.createNode('A3BLoader'); app.graph.add(L); L.pos = [80, 60];
      await redraw();
      const shown = L.widgets.filter(w => L.isWidgetVisible(w)).map(w => w.name);
      const simple = {shown, size: Array.from(L.size), need: Array.from(L.computeSize())};
      L.toggleAdvanced(); await redraw();
      const all = {shown: L.widgets.filter(w => L.isWidgetVisible(w)).map(w => w.name), size: Array.from(L.size),
                   last: L.widgets[L.widgets.length - 1].y};
      const n = L.widgets.find(w => w.name === 'n_ctx');
      const typed = [512, 2048, 4096, 8192, 32768].map(v => { n.callback(v); return n.value; });
      const P = LiteGraph.createNode('A3BPrune'); app.graph.add(P);
      return {simple, all, typed, prune: P.widgets.map(w => w.name)};"""
    got = run_async(browser, body)
    assert "error" not in got, got
    assert got["simple"]["shown"] == ["model", "n_ctx", "n_gpu_layers", "mmproj", "lora", "lora_strength"], got
    assert got["simple"]["size"][1] <= got["simple"]["need"][1] + 2       # no empty band for hidden widgets
    assert len(got["all"]["shown"]) > 12 and "kv_cache_type" in got["all"]["shown"]
    assert got["all"]["last"] < got["all"]["size"][1]                    # shown, the node grew to hold them
    assert got["typed"] == [512, 2048, 4096, 8192, 32768]
    assert got["prune"][:2] == ["keep_ratio", "prune_method"]


def test_an_api_format_file_opens_with_its_values(browser):
    """A dropped API-format file (examples/api) opens with the values it holds: n_ctx 2048 stays 2048."""
    for name in EXAMPLE_NAMES:
        data = json.loads((EXAMPLES / "api" / f"{name}.api.json").read_text())
        got = run_async(browser, "app.graph.clear(); await app.loadApiJson(args[0], 'x.api.json');"
                                 "return app.graph._nodes.filter(n => n.type === 'A3BLoader')"
                                 ".map(n => n.widgets.find(w => w.name === 'n_ctx').value);", data)
        assert got == [data["1"]["inputs"]["n_ctx"]], (name, got)


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
