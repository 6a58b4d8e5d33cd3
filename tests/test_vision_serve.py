"""Images in over the surfaces, with the fake engine: `a3b serve`'s image_url content parts and its
vision flag, the remote engine passing image parts to a server, `a3b generate --image`.
"""
from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest

from comfyui_a3b.runtime.errors import VisionUnavailable
from comfyui_a3b.runtime.images import RGBImage, png_bytes
from comfyui_a3b.runtime.remote.wire import request_body
from comfyui_a3b.runtime.requests import ChatPrompt, GenerationRequest, ImagePart

TOKEN = "vision-token"
SEEING = "fake://seeing?vision=1"


def png(seed: int) -> bytes:
    px = np.random.default_rng(seed).integers(0, 256, (6, 8, 3), dtype=np.uint8).tobytes()
    return png_bytes(RGBImage(8, 6, px, ""))


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


@pytest.fixture(scope="module")
def servers(fake_engine):
    from comfyui_a3b.runtime import get_runtime
    from comfyui_a3b.serve import Server

    rt = get_runtime()
    seeing = Server(rt.spec(SEEING, n_parallel=2, n_ctx=512), "127.0.0.1", 0, token=TOKEN, name="seeing").start()
    blind = Server(rt.spec("fake://blind", n_parallel=2, n_ctx=512), "127.0.0.1", 0, token=TOKEN, name="blind").start()
    rt.load(seeing.cfg.spec)
    rt.load(blind.cfg.spec)
    try:
        yield seeing, blind
    finally:
        seeing.stop()
        blind.stop()


def client(srv) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", headers={"Authorization": f"Bearer {TOKEN}"},
                        timeout=20, trust_env=False)


def ask(c: httpx.Client, content, **extra) -> httpx.Response:
    return c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                "max_tokens": 10, "temperature": 0, **extra})


def test_serve_takes_image_url_data_urls_and_says_it_sees(servers):
    seeing, blind = servers
    with client(seeing) as c:
        models = c.get("/v1/models").json()["data"][0]
        assert models["vision"] is True and c.get("/props").json()["modalities"]["vision"] is True
        def with_image(seed):
            return [{"type": "text", "text": "What is it?"},
                    {"type": "image_url", "image_url": {"url": data_url(seed)}}]

        one, again, other = ask(c, with_image(1)), ask(c, with_image(1)), ask(c, with_image(2))
        assert one.status_code == 200, one.text
        text = [r.json()["choices"][0]["message"]["content"] for r in (one, again, other)]
        assert text[0] == text[1] != text[2]
        # a remote URL is refused: the server fetches nothing
        r = ask(c, [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])
        assert r.status_code == 400 and "nothing is fetched" in r.json()["error"]["message"]
        r = ask(c, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
        assert r.status_code == 400 and "not an image" in r.json()["error"]["message"]
        r = ask(c, [{"type": "input_audio", "input_audio": {}}])
        assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]
    with client(blind) as c:
        assert c.get("/v1/models").json()["data"][0]["vision"] is False
        r = ask(c, [{"type": "image_url", "image_url": {"url": data_url(1)}}, {"type": "text", "text": "hi"}])
        assert r.status_code == 400 and "mmproj" in r.json()["error"]["message"]
        # text parts alone still work
        assert ask(c, [{"type": "text", "text": "hi"}]).status_code == 200


def test_the_remote_engine_passes_image_parts_through(servers, monkeypatch):
    from comfyui_a3b.runtime import get_runtime, preset

    seeing, _ = servers
    monkeypatch.setenv("A3B_REMOTE_API_KEY", TOKEN)
    rt = get_runtime()
    url = f"http://127.0.0.1:{seeing.port}/v1"
    prompt = ChatPrompt([{"role": "user", "content": ("What is it?", ImagePart(data=png(1), mime="image/png"))}])
    try:
        remote = rt.generate(prompt, model=url, max_tokens=10, sampling=preset("greedy"))
        assert rt.load(url).features.get("vision") is True   # read from the server's /props, as llama-server's
    finally:
        rt.unload(rt.spec(url))
    blind_url = f"http://127.0.0.1:{servers[1].port}/v1"
    try:   # a server that reports no vision: said here, before anything is sent
        with pytest.raises(VisionUnavailable, match="--mmproj"):
            rt.generate(prompt, model=blind_url, max_tokens=3)
    finally:
        rt.unload(rt.spec(blind_url))
    local = rt.generate(prompt, model=SEEING, max_tokens=10, sampling=preset("greedy"), )
    plain = rt.generate(ChatPrompt([{"role": "user", "content": "What is it?"}]), model=SEEING, max_tokens=10,
                        sampling=preset("greedy"))
    assert remote.text == local.text != plain.text


def test_wire_body_of_a_chat_with_images():
    px = ImagePart(rgb=bytes(range(6 * 4 * 3)) * 1, width=6, height=4)
    req = GenerationRequest(ChatPrompt([{"role": "user", "content": ("look", px, "now")}]))
    path, root, body = request_body(req, "m", False)
    parts = body["messages"][0]["content"]
    assert path == "/chat/completions" and [p["type"] for p in parts] == ["text", "image_url", "text"]
    raw = base64.b64decode(parts[1]["image_url"]["url"].split(",", 1)[1])
    assert raw.startswith(b"\x89PNG")
    from comfyui_a3b.runtime.images import decode

    assert decode(ImagePart(data=raw)).rgb == px.rgb
    named = GenerationRequest(ChatPrompt([{"role": "user", "content": ("look", px)}], template="chatml"))
    with pytest.raises(Exception, match="named chat template renders text only"):
        request_body(named, "m", False)


def test_cli_generate_image(fake_engine, tmp_path, capsys):
    from comfyui_a3b import cli

    img = tmp_path / "cat.png"
    img.write_bytes(png(3))
    assert cli.main(["generate", "-m", SEEING, "--image", str(img), "--image", str(img), "Describe", "--max-tokens",
                     "6", "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_prompt_tokens"] > 8 and out["text"]
    assert cli.main(["generate", "-m", "fake://blind", "--image", str(img), "Describe"]) == 2
    assert "mmproj" in capsys.readouterr().err
    assert cli.main(["generate", "-m", SEEING, "--image", str(tmp_path / "missing.png"), "x"]) == 2
    assert "Cannot read the image" in capsys.readouterr().err
    assert cli.main(["generate", "-m", SEEING, "--raw", "--image", str(img), "x"]) == 2
    assert "chat prompt" in capsys.readouterr().err
