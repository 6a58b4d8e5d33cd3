"""A real ComfyUI with the pack: runs when COMFYUI_DIR points at a ComfyUI checkout.

ComfyUI is started as `python main.py --cpu --listen 127.0.0.1 --port P` with the pack added through
an extra-paths file (the checkout's own custom_nodes folder is left alone), and driven over its
HTTP and websocket API. COMFYUI_PYTHON picks the interpreter that has ComfyUI's requirements
(default: this one).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from comfyui_a3b.bench.common import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
A3B_NODES = {"A3BLoader", "A3BPrune", "A3BRouter", "A3BGenerate", "A3BEmbed", "A3BTopK", "A3BUnload"}

pytestmark = [pytest.mark.comfyui, pytest.mark.slow,
              pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout")]


class ComfyServer:
    """One ComfyUI process with the pack; stopped by `stop()`."""

    def __init__(self, workdir: Path, with_pack: bool = True, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        nodes_dir = workdir / "custom_nodes"
        nodes_dir.mkdir(parents=True, exist_ok=True)
        if with_pack:
            (nodes_dir / "comfyui-a3b").symlink_to(ROOT, target_is_directory=True)
        self.llm_dir = workdir / "LLM"
        self.llm_dir.mkdir(exist_ok=True)
        cfg = workdir / "extra_paths.yaml"
        cfg.write_text(f"a3b_test:\n  custom_nodes: {nodes_dir}\n  LLM: {self.llm_dir}\n")
        for d in ("user", "output", "temp", "input"):
            (workdir / d).mkdir(exist_ok=True)
        self.log_path = workdir / "comfyui.log"
        py = os.environ.get("COMFYUI_PYTHON", sys.executable)
        cmd = [py, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
               "--extra-model-paths-config", str(cfg), "--user-directory", str(workdir / "user"),
               "--output-directory", str(workdir / "output"), "--temp-directory", str(workdir / "temp"),
               "--input-directory", str(workdir / "input"), "--database-url", "sqlite:///:memory:"]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=COMFYUI_DIR, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})})
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            try:
                self.get("/system_stats")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"ComfyUI did not start in 180 s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str):
        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return json.load(r)

    def post(self, path: str, data: dict | None = None):
        req = urllib.request.Request(self.base + path, data=json.dumps(data or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            return json.loads(body) if body else None

    def queue(self, prompt: dict, client_id: str | None = None) -> str:
        return self.post("/prompt", {"prompt": prompt, **({"client_id": client_id} if client_id else {})})["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 300) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            h = self.get(f"/history/{prompt_id}")
            if prompt_id in h and h[prompt_id].get("status", {}).get("status_str") in ("success", "error"):
                return h[prompt_id]
            time.sleep(0.25)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout} s")

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def example(name: str) -> dict:
    return json.loads((EXAMPLES / "api" / f"{name}.api.json").read_text())


def gen_prompt(prompt: str, max_new_tokens: int = 24, seed: int = 1, **inputs) -> dict:
    return {
        "1": {"class_type": "A3BLoader", "inputs": {"model": "(default)", "n_ctx": 2048, "n_gpu_layers": 0,
                                                    "threads": 0, "flash_attn": "auto", "kv_cache_type": "f16"}},
        "2": {"class_type": "A3BGenerate", "inputs": {
            "model": ["1", 0], "prompt": prompt, "system": "", "max_new_tokens": max_new_tokens,
            "temperature": 0.4, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1,
            "seed": seed, "stop": "", "confidence_aware": False, **inputs}},
    }


async def run_with_ws(server: ComfyServer, prompt: dict, on_token=None, timeout: float = 300) -> dict:
    """Queue `prompt` as a websocket client; collect every message until the prompt ends."""
    import websockets

    cid = str(uuid.uuid4())
    msgs: list[dict] = []
    async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws?clientId={cid}", max_size=None) as ws:
        pid = await asyncio.to_thread(server.queue, prompt, cid)
        t_queued = time.perf_counter()
        end = time.time() + timeout
        while time.time() < end:
            raw = await asyncio.wait_for(ws.recv(), timeout=end - time.time())
            if isinstance(raw, bytes):
                continue
            m = json.loads(raw)
            m["at"] = time.perf_counter()
            m["t"] = m["at"] - t_queued
            msgs.append(m)
            if m["type"] == "a3b.token" and on_token is not None:
                await on_token(m, msgs)
            data = m.get("data") or {}
            if data.get("prompt_id") == pid and m["type"] in ("execution_success", "execution_error",
                                                              "execution_interrupted"):
                break
    return {"prompt_id": pid, "messages": msgs}


def combo_options(entry) -> list:
    """A dropdown's choices in /object_info: V1 lists them first, V3 as ("COMBO", {"options": ...})."""
    return entry[0] if isinstance(entry[0], list) else entry[1]["options"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ComfyServer(tmp_path_factory.mktemp("comfyui"))
    yield s
    s.stop()


def test_pack_imports_and_lists_nodes(server):
    info = server.get("/object_info")
    assert A3B_NODES <= set(info)
    gen = info["A3BGenerate"]
    assert gen["input"]["required"]["max_new_tokens"][1]["default"] == 512
    assert gen["input"]["required"]["seed"][1]["control_after_generate"] is True
    assert gen["output_node"] is True and gen["output"] == ["STRING", "STRING", "STRING"]
    assert info["A3BEmbed"]["output_is_list"] == [False, True]
    assert combo_options(info["A3BLoader"]["input"]["required"]["model"])[0] == "(default)"
    # the V1 rendering used outside ComfyUI says the same as ComfyUI's rendering of the V3 nodes
    from comfyui_a3b.nodes.defs import BY_ID
    from comfyui_a3b.nodes.v1 import input_types

    for name in A3B_NODES:
        ours = input_types(BY_ID[name])
        for section in ("required", "optional"):
            assert list(ours.get(section, {})) == list(info[name]["input"].get(section, {})), (name, section)
            for key, (typ, opts) in ours.get(section, {}).items():
                theirs = info[name]["input"][section][key]
                assert ((typ if isinstance(typ, str) else "COMBO")
                        == (theirs[0] if isinstance(theirs[0], str) else "COMBO"))
                if not isinstance(typ, str):
                    assert typ == combo_options(theirs), (name, key)
                for k in ("default", "min", "max", "multiline", "forceInput", "control_after_generate"):
                    assert (opts.get(k) or None) == (theirs[1].get(k) or None), (name, key, k)
    log = server.log()
    assert not [ln for ln in log.splitlines() if "IMPORT FAILED" in ln and "comfyui-a3b" in ln], log[-3000:]
    assert "Traceback" not in "\n".join(ln for ln in log.splitlines() if "a3b" in ln.lower())
    st = server.get("/a3b/status")
    assert st["pid"] == server.proc.pid and "models" in st
    assert not (st.get("lsp") or {}).get("running")  # the in-process language server is off by default


def test_rag_example_answers_from_the_documents(server):
    h = server.wait(server.queue(example("rag")))
    assert h["status"]["status_str"] == "success", h["status"]
    out = h["outputs"]
    assert "7:15" in out["7"]["text"][0]
    assert out["6"]["text"][0].splitlines()[0].split("  ", 1)[1].startswith("The ferry to Harrow Island leaves")


def test_comic_example_writes_every_part(server):
    h = server.wait(server.queue(example("comic_script")))
    assert h["status"]["status_str"] == "success", h["status"]
    out = h["outputs"]
    for node_id in ("3", "4", "5", "6"):
        assert len(out[node_id]["text"][0].strip()) > 10, (node_id, out[node_id])
    storyboard = out["3"]["text"][0]
    # the premise reached the storyboard node. Whether the embedded 135M model keeps to "exactly 3
    # panels" at the workflow's seed depends on the machine's arithmetic: over seeds 40-47 it wrote
    # all three in 3 of 8 (README limits), so the panel count is not the workflow's to promise
    assert any(w in storyboard.lower() for w in ("bolt", "mira", "lighthouse", "robot")), storyboard
    script = out["8"]["text"][0]
    assert out["4"]["text"][0] in script and out["5"]["text"][0] in script  # dialogue reached the text node
    # both voices labelled, each above its lines
    assert script.startswith("--- Mira ---\n" + out["4"]["text"][0]) and "\n--- Bolt ---\n" in script, script
    assert out["9"]["text"][0] == out["6"]["text"][0]


def test_tokens_stream_with_progress_then_cache_hit(server):
    p = gen_prompt("Write two sentences about autumn.", max_new_tokens=40, seed=123)
    r = asyncio.run(run_with_ws(server, p))
    tokens = [m for m in r["messages"] if m["type"] == "a3b.token" and m["data"]["node"] == "2"]
    final = server.wait(r["prompt_id"])["outputs"]["2"]["text"][0]
    assert len(tokens) > 3 and "".join(m["data"]["text"] for m in tokens) == final
    executed = next(m for m in r["messages"] if m["type"] == "executed" and m["data"]["node"] == "2")
    assert tokens[-1]["t"] <= executed["t"] and tokens[1]["t"] < executed["t"]  # streamed, not at the end
    progress = [m["data"]["value"] for m in r["messages"] if m["type"] == "progress" and m["data"]["node"] == "2"]
    assert len(progress) >= len(tokens) - 2 and progress == sorted(progress)
    # the same workflow again: ComfyUI's cache answers, nothing is generated
    again = asyncio.run(run_with_ws(server, p))
    cached = next(m for m in again["messages"] if m["type"] == "execution_cached")
    assert {"1", "2"} <= set(cached["data"]["nodes"])
    assert not [m for m in again["messages"] if m["type"] == "a3b.token"]
    assert server.wait(again["prompt_id"])["outputs"]["2"]["text"][0] == final
    # change one input: it runs again
    changed = asyncio.run(run_with_ws(server, gen_prompt("Write two sentences about autumn.", max_new_tokens=40,
                                                         seed=124)))
    assert [m for m in changed["messages"] if m["type"] == "a3b.token"]


def test_interrupt_stops_a_long_generation_between_tokens(server):
    state: dict = {}

    async def on_token(m, msgs):
        n = sum(1 for x in msgs if x["type"] == "a3b.token")
        if n == 5 and "t_interrupt" not in state:
            state["t_interrupt"] = m["t"]
            await asyncio.to_thread(server.post, "/interrupt")

    p = gen_prompt("Write a very long story about a dragon and a knight.", max_new_tokens=1800, seed=9)
    r = asyncio.run(run_with_ws(server, p, on_token=on_token))
    end = r["messages"][-1]
    assert end["type"] == "execution_interrupted", [m["type"] for m in r["messages"]][-5:]
    latency = end["t"] - state["t_interrupt"]
    print(f"cancel latency while decoding: {latency:.3f} s")
    assert latency < 1.0   # within 0.5 s, with slack for a busy machine
    n_tokens = sum(1 for m in r["messages"] if m["type"] == "a3b.token")
    assert n_tokens < 200
    # the model is still fine: the next prompt runs normally
    h = server.wait(server.queue(gen_prompt("Say hello.", max_new_tokens=8, seed=3)))
    assert h["status"]["status_str"] == "success" and h["outputs"]["2"]["text"][0]


#: a prompt the embedded model reads for several seconds on two cores (about 1500 tokens)
LONG_PROMPT = "Summarise the following notes in one sentence.\n\n" + " ".join(
    f"Note {i}: the ferry to Harrow Island leaves the north pier at seven fifteen." for i in range(90))


def test_interrupt_while_the_prompt_is_read_takes_effect_at_once(server):
    """POST /interrupt while a long prompt is being read (no token generated yet) ends the run within
    half a second: the running batch is stopped, not waited for; the model answers normally after."""
    state: dict = {}

    async def main():
        async def interrupt_soon():
            await asyncio.sleep(1.5)   # the prompt is being read by then (the model is loaded already)
            state["t_interrupt"] = time.perf_counter()
            await asyncio.to_thread(server.post, "/interrupt")

        task = asyncio.ensure_future(interrupt_soon())
        r = await run_with_ws(server, p)
        await task
        return r

    server.wait(server.queue(gen_prompt("Say hi.", max_new_tokens=2, seed=4)))   # loaded before the run
    p = gen_prompt(LONG_PROMPT, max_new_tokens=64, seed=11)
    r = asyncio.run(main())
    end = r["messages"][-1]
    assert end["type"] == "execution_interrupted", [m["type"] for m in r["messages"]][-5:]
    assert not [m for m in r["messages"] if m["type"] == "a3b.token" and m["data"].get("text")]  # still reading
    latency = end["at"] - state["t_interrupt"]
    print(f"cancel latency while reading the prompt: {latency:.3f} s")
    assert latency < 1.0   # within 0.5 s, with slack for a busy machine
    h = server.wait(server.queue(gen_prompt("Say hello.", max_new_tokens=8, seed=3)))
    assert h["status"]["status_str"] == "success" and h["outputs"]["2"]["text"][0]


def test_free_and_unload_route_release_our_models(server):
    server.wait(server.queue(gen_prompt("Say yes.", max_new_tokens=4, seed=77)))
    assert server.get("/a3b/status")["models"]
    server.post("/free", {"unload_models": True})
    deadline = time.time() + 20
    while server.get("/a3b/status")["models"] and time.time() < deadline:
        time.sleep(0.2)
    assert server.get("/a3b/status")["models"] == []
    # a new generation reloads on demand through the handle
    h = server.wait(server.queue(gen_prompt("Say no.", max_new_tokens=4, seed=78)))
    assert h["status"]["status_str"] == "success"
    assert server.get("/a3b/status")["models"]
    r = server.post("/a3b/unload")
    assert r["unloaded"] >= 1 and r["status"]["models"] == []


def test_bad_inputs_over_the_api(server):
    for ref in ("/etc/passwd", "../../../../../../etc/passwd", "no-such-model.gguf"):
        bad = gen_prompt("hi")
        bad["1"]["inputs"]["model"] = ref
        try:
            pid = server.queue(bad)
        except urllib.error.HTTPError as e:  # refused by ComfyUI's own validation: fine too
            assert e.code == 400
            continue
        h = server.wait(pid)
        err = next(m for m in h["status"]["messages"] if m[0] == "execution_error")[1]
        assert err["node_type"] == "A3BLoader"
        expected = "No model named" if ref.startswith("no-such") else "outside the allowed model folders"
        assert expected in err["exception_message"], err
    h = server.wait(server.queue(gen_prompt("   ")))
    assert h["status"]["status_str"] == "error"
    err = next(m for m in h["status"]["messages"] if m[0] == "execution_error")[1]
    assert err["node_type"] == "A3BGenerate" and "prompt is empty" in err["exception_message"]
    # the error's type as a name, not the folder path ComfyUI imported the pack under
    assert err["exception_type"] == "comfyui_a3b.runtime.errors.InvalidRequest", err["exception_type"]
    # max_new_tokens beyond what the context holds is not refused: the answer ends at the context's end
    # and the node says so beside it (in the CLI's words)
    long = gen_prompt("Write a long story about a dragon, chapter by chapter.", max_new_tokens=1000)
    long["1"]["inputs"]["n_ctx"] = 256
    h = server.wait(server.queue(long))
    assert h["status"]["status_str"] == "success", h["status"]
    out = h["outputs"]["2"]
    assert out["text"][0] and "the context is full" in out["note"][0] and "n_ctx 256" in out["note"][0], out


def test_model_folder_file_replaced_on_disk_is_reloaded(server, default_path, tiny_models):
    import shutil

    target = server.llm_dir / "swap.gguf"
    shutil.copy(default_path, target)
    names = server.get("/a3b/models")["models"]
    assert "swap.gguf" in names
    p = gen_prompt("Say hi.", max_new_tokens=6, seed=5)
    p["1"]["inputs"]["model"] = "swap.gguf"
    first = server.wait(server.queue(p))
    assert first["status"]["status_str"] == "success"
    loads = server.get("/a3b/status")["weight_loads"]
    shutil.copy(tiny_models["llama"], target)
    second = server.wait(server.queue(p))  # same inputs, but the file changed: not a cache hit
    assert second["status"]["status_str"] == "success"
    st = server.get("/a3b/status")
    assert st["weight_loads"] == loads + 1
    swap = [m for m in st["models"] if m["name"] == "swap.gguf"]
    assert swap and swap[0]["weights_bytes"] < 10_000_000  # the tiny model now, not the 98 MB one


async def _editor_completion(port: int) -> list:
    """One inline completion from the in-process language server, as an editor asks (no model setting)."""
    from lsp_helpers import SAMPLE, SINGLE, RawClient

    raw = await RawClient.tcp("127.0.0.1", port)
    try:
        assert "result" in await raw.initialize(options={"debounceMs": 0})
        raw.notify("textDocument/didOpen", {"textDocument": {"uri": "file:///w/a.py", "languageId": "python",
                                                             "version": 1, "text": SAMPLE}})
        raw.request(1, "textDocument/inlineCompletion", {
            "textDocument": {"uri": "file:///w/a.py"}, "position": {"line": SINGLE.line, "character": SINGLE.character},
            "context": {"triggerKind": 2}})
        res = await raw.response(1, timeout=240)
        assert "result" in res, res
        return res["result"]["items"] if isinstance(res["result"], dict) else res["result"]
    finally:
        await raw.close()


@pytest.mark.parametrize("placement", [0, "example"])
def test_a_workflow_the_server_and_an_editor_share_one_copy_of_the_weights(tmp_path_factory, placement):
    """ComfyUI with the in-process language server and OpenAI-compatible server: the RAG example
    (with n_gpu_layers 0, or as shipped), then a chat request and an editor's completion, which ask
    for "the model" (n_gpu_layers "auto"): one load of the file, listed once in /a3b/status."""
    lsp_port, http_port = free_port(), free_port()
    s = ComfyServer(tmp_path_factory.mktemp("comfyui-shared"),
                    env={"A3B_LSP": f"tcp:127.0.0.1:{lsp_port}", "A3B_SERVE": f"127.0.0.1:{http_port}"})
    try:
        wf = example("rag")
        if placement != "example":
            wf["1"]["inputs"]["n_gpu_layers"] = placement
        assert s.wait(s.queue(wf))["status"]["status_str"] == "success"
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", headers={
            "Content-Type": "application/json"}, data=json.dumps({
                "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}).encode())
        with urllib.request.urlopen(req, timeout=240) as r:
            assert json.load(r)["choices"][0]["message"]["content"] is not None
        asyncio.run(_editor_completion(lsp_port))
        st = s.get("/a3b/status")
        assert st["weight_loads"] == 1, st
        assert len(st["models"]) == 1 and st["models"][0]["warnings"] == [], st["models"]
        log = s.log()
        assert log.count("language server listening on") == 1 and "{'running'" not in log, log[-3000:]
        assert "GPU models" not in log    # --cpu: no card to share
    finally:
        s.stop()


def test_image_example_describes_the_image_then_writes_dialogue(server):
    """examples/image_dialogue in a real ComfyUI: LoadImage -> A3B Generate with the image (the projector
    found beside the model) -> A3B Generate of dialogue from the description. Tiny random weights (a
    llama text model and an LLaVA-style projector the tests write): the text means nothing, but it
    is the same for the same image and seed, and another image changes it."""
    import numpy as np
    from PIL import Image

    from comfyui_a3b.bench.mmproj import write_mmproj
    from tinygguf import write_tiny_gguf

    write_tiny_gguf(server.llm_dir / "tiny-vl-llama.gguf", "llama", n_ctx=1024)
    write_mmproj(server.llm_dir / "mmproj-tiny-vl-llama-f32.gguf", 64, "tiny-mlp")
    rng = np.random.default_rng(7)
    for name in ("panel-a.png", "panel-b.png"):
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(server.workdir / "input" / name)

    def run(image: str) -> dict:
        wf = example("image_dialogue")
        wf["1"]["inputs"].update(model="tiny-vl-llama.gguf", mmproj="auto", n_ctx=1024)
        wf["2"]["inputs"]["image"] = image
        for node in ("3", "4"):
            # sampled with the example's seed: a random model's greedy text hardly moves with its input,
            # a draw from its flat distributions does
            wf[node]["inputs"].update(max_new_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
        h = server.wait(server.queue(wf))
        assert h["status"]["status_str"] == "success", h["status"]
        return {n: h["outputs"][n]["text"][0] for n in ("3", "4")}

    a = run("panel-a.png")
    assert a["3"].strip() and a["4"].strip(), a
    summary = server.get("/history")   # the loader's summary names the projector in use
    loader_texts = [h["outputs"]["1"]["text"][0] for h in summary.values() if "1" in h.get("outputs", {})
                    and "tiny-vl-llama" in h["outputs"]["1"]["text"][0]]
    assert loader_texts and "projector mmproj-tiny-vl-llama-f32.gguf" in loader_texts[-1], loader_texts
    assert run("panel-a.png")["3"] == a["3"]          # the same image and seed: the same description
    assert run("panel-b.png")["3"] != a["3"]          # another image: another one
    st = server.get("/a3b/status")
    assert any(m.get("features", {}).get("vision") for m in st["models"]), st["models"]
