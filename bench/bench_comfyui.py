"""ComfyUI pack benchmarks, against a real ComfyUI (COMFYUI_DIR) and headless Chromium.

    COMFYUI_DIR=/path/to/ComfyUI python -m comfyui_a3b.bench.bench_comfyui [--reps 5]

1. Time to first token: from queueing an A3BGenerate prompt in the browser (the page's own
   websocket client) to the first streamed token arriving in the page, against the same generation
   submitted to the runtime directly in this process (the baseline, measured in the same run).
2. Second run of an unchanged workflow (the RAG example): ComfyUI's cache answers; ratio to the
   first run.
3. Memory (RSS) of ComfyUI idle with the pack, against ComfyUI without it; and with the model loaded,
   and after "Unload models" (/free).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from comfyui_a3b.bench.common import arguments, median, plot, print_table, write_results

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _prompt(text: str, seed: int, max_new_tokens: int = 16) -> dict:
    from test_comfyui_live import gen_prompt

    return gen_prompt(text, max_new_tokens=max_new_tokens, seed=seed)


def _browser(server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--window-size=1400,900"):
        opts.add_argument(flag)
    drv = webdriver.Chrome(service=Service(os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")), options=opts)
    drv.set_script_timeout(120)
    drv.get(server.base + "/")
    deadline = time.time() + 90
    while not drv.execute_script("return !!(window.comfyAPI && window.comfyAPI.api && window.LiteGraph"
                                 " && window.LiteGraph.registered_node_types['A3BGenerate'])"):
        if time.time() > deadline:
            raise TimeoutError("ComfyUI's page did not load")
        time.sleep(0.2)
    return drv


BROWSER_TTFT = """
const done = arguments[arguments.length - 1];
const api = window.comfyAPI.api.api;
let t0 = 0;
const onTok = (ev) => {
  if (!ev.detail.text) return;
  api.removeEventListener('a3b.token', onTok);
  done(performance.now() - t0);
};
api.addEventListener('a3b.token', onTok);
t0 = performance.now();
api.queuePrompt(0, {output: arguments[0], workflow: {}}).catch(e => done(String(e)));
"""


def time_to_first_token(server, reps: int) -> dict:
    from comfyui_a3b.runtime import ChatPrompt, SamplingParams, chat, get_runtime

    rt = get_runtime()
    drv = _browser(server)
    try:
        # warm both sides: the model loaded in ComfyUI and here
        server.wait(server.queue(_prompt("Warm up.", seed=1, max_new_tokens=2)))
        rt.generate("Warm up.", max_tokens=2)
        browser, direct = [], []
        for i in range(reps):
            text = f"Request {i}: name one colour of the sky."
            ms = drv.execute_async_script(BROWSER_TTFT, _prompt(text, seed=100 + i))
            if not isinstance(ms, (int, float)):
                raise RuntimeError(f"browser: {ms}")
            browser.append(ms / 1000)
            time.sleep(1.0)  # let ComfyUI finish the prompt before the baseline runs
            text = f"Baseline {i}: name one colour of the sky."
            t0 = time.perf_counter()
            first: list[float] = []
            m = rt.load()
            rendered = m.render_chat(ChatPrompt(chat.messages(text, None)))
            stream = rt.submit(rendered, chat=False, max_tokens=16, sampling=SamplingParams(seed=100 + i),
                               on_token=lambda ev, first=first: (first.append(time.perf_counter())
                                                                 if ev.text and not first else None))
            stream.result()
            direct.append(first[0] - t0 if first else float("nan"))
        return {"browser_s": browser, "runtime_s": direct}
    finally:
        drv.quit()


def second_run(server) -> dict:
    from test_comfyui_live import example

    wf = example("rag")
    out = {}
    for label in ("first", "second"):
        t0 = time.perf_counter()
        h = server.wait(server.queue(wf))
        out[label] = time.perf_counter() - t0
        assert h["status"]["status_str"] == "success"
    return out


def main(argv=None) -> None:
    ap = arguments(__doc__)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if not os.environ.get("COMFYUI_DIR"):
        sys.exit("set COMFYUI_DIR to a ComfyUI checkout")
    from test_comfyui_live import ComfyServer

    work = Path(tempfile.mkdtemp(prefix="a3b-bench-"))
    bare = ComfyServer(work / "bare", with_pack=False)
    time.sleep(3)
    rss_without = bare.rss()
    bare.stop()

    server = ComfyServer(work / "pack")
    try:
        time.sleep(3)
        rss_idle = server.rss()
        ttft = time_to_first_token(server, args.reps)
        rss_loaded = server.rss()
        runs = second_run(server)
        server.post("/free", {"unload_models": True})
        time.sleep(3)
        rss_freed = server.rss()
    finally:
        server.stop()

    b, d = median(ttft["browser_s"]), median(ttft["runtime_s"])
    mb = 1 << 20
    rows = [
        ["first token: runtime alone (baseline)", f"{d * 1000:.0f} ms", "1.00"],
        ["first token: queued in ComfyUI, seen in the browser", f"{b * 1000:.0f} ms", f"{b / d:.2f}"],
        ["RAG example, first run", f"{runs['first']:.2f} s", "1.00"],
        ["RAG example, unchanged second run (cache)", f"{runs['second']:.3f} s",
         f"{runs['second'] / runs['first']:.3f}"],
        ["ComfyUI RSS without the pack (baseline)", f"{rss_without / mb:.0f} MB", "1.00"],
        ["ComfyUI RSS with the pack, idle", f"{rss_idle / mb:.0f} MB", f"{rss_idle / rss_without:.3f}"],
        ["... after generating (model loaded)", f"{rss_loaded / mb:.0f} MB", f"{rss_loaded / rss_without:.3f}"],
        ["... after Unload models (/free)", f"{rss_freed / mb:.0f} MB", f"{rss_freed / rss_without:.3f}"],
    ]
    print_table(f"ComfyUI pack (medians of {args.reps})", ["measure", "value", "ratio"], rows)
    write_results("bench_comfyui", {
        "comfyui_dir_commit": _commit(os.environ["COMFYUI_DIR"]), "reps": args.reps,
        "ttft": ttft, "ttft_median_s": {"browser": b, "runtime": d, "ratio": b / d},
        "rag_runs_s": runs, "rag_second_over_first": runs["second"] / runs["first"],
        "rss_bytes": {"without_pack": rss_without, "idle": rss_idle, "loaded": rss_loaded, "after_free": rss_freed},
    })

    def draw(ax_unused):
        import matplotlib.pyplot as plt

        fig = ax_unused.figure
        fig.clf()
        a1, a2, a3 = fig.subplots(1, 3)
        a1.bar(["runtime", "browser"], [d * 1000, b * 1000], color=["grey", "tab:blue"])
        a1.set_title("time to first token (ms)")
        a2.bar(["first", "second"], [runs["first"], runs["second"]], color=["grey", "tab:green"])
        a2.set_title("RAG workflow run (s)")
        a3.bar(["no pack", "idle", "loaded", "freed"], [x / mb for x in (rss_without, rss_idle, rss_loaded, rss_freed)],
               color=["grey", "tab:orange", "tab:red", "tab:orange"])
        a3.set_title("ComfyUI RSS (MB)")
        for a in (a1, a2, a3):
            a.tick_params(axis="x", labelrotation=20)
        plt.tight_layout()

    plot("bench_comfyui", draw, size=(11, 4))


def _commit(path: str) -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - the commit is only a label on the results; no git is no reason to stop
        return None


if __name__ == "__main__":
    main()
