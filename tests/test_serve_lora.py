"""`a3b serve --lora`: the adapter's id and the plain base's, over one loaded copy of the weights."""
from __future__ import annotations

import httpx

from serve_helpers import MODEL


def test_serve_with_an_adapter_also_serves_the_base(fake_engine, tmp_path):
    from comfyui_a3b.runtime import get_runtime
    from comfyui_a3b.serve import Server
    from comfyui_a3b.serve.config import model_id

    rt = get_runtime()
    adapter = tmp_path / "myrepo.lora.gguf"
    adapter.write_bytes(b"")        # the fake engine does not read it
    spec = rt.spec(MODEL, n_parallel=2, n_ctx=256, lora_path=str(adapter))
    base_id = model_id(rt.spec(MODEL, n_parallel=2, n_ctx=256))
    srv = Server(spec, "127.0.0.1", 0).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=20, trust_env=False) as c:
            ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
            assert ids == ["myrepo.lora", base_id]
            answers = {}
            for name in (None, "myrepo.lora", base_id):
                body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
                if name:
                    body["model"] = name
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                answers[name] = r.json()["model"]
            assert answers == {None: "myrepo.lora", "myrepo.lora": "myrepo.lora", base_id: base_id}
            assert c.post("/v1/completions", json={"prompt": "x", "model": "other"}).status_code == 404
    finally:
        srv.stop()
    with_lora, plain = rt.loaded(spec), rt.loaded(rt.spec(MODEL, n_parallel=2, n_ctx=256))
    assert with_lora is not None and plain is not None and with_lora is not plain   # a context each
    weights = {e.weights_key for e in rt.store._entries.values() if e.spec.path == MODEL}
    assert len(weights) == 1                                                      # one copy of the weights


def test_the_editors_lora_setting(fake_engine, tmp_path, monkeypatch):
    from comfyui_a3b.lsp_server import config as cfg
    from comfyui_a3b.lsp_server.session import Engine, Session

    loras, elsewhere = tmp_path / "loras", tmp_path / "elsewhere"
    loras.mkdir()
    elsewhere.mkdir()
    monkeypatch.setenv("A3B_LORAS", str(loras))
    adapter = loras / "ws.lora.gguf"
    adapter.write_bytes(b"")
    outside = elsewhere / "ws.lora.gguf"
    outside.write_bytes(b"")
    (loras / "link.gguf").symlink_to(outside)
    eng = Engine(default_model=MODEL)
    s = Session(eng)
    try:
        assert s.configure({"a3b": {"lora": str(adapter), "loraScale": 0.5}}) == []
        assert s.spec().lora_path == str(adapter.resolve()) and s.spec().lora_scale == 0.5
        assert s.configure({"lora": None}) == [] and s.spec().lora_path is None
        assert s.configure({"lora": "ws.lora.gguf"}) == []          # a name in a LoRA folder
        assert s.spec().lora_path == str(adapter.resolve())
        for bad, words in (("none.gguf", "names no GGUF file in the LoRA folders"),
                           (str(outside), "is outside the LoRA folders"),
                           (str(loras / "link.gguf"), "is outside the LoRA folders"),
                           ("../elsewhere/ws.lora.gguf", "is outside the LoRA folders"),
                           (str(tmp_path / "none.gguf"), "is outside the LoRA folders")):
            errors = s.configure({"lora": bad})
            assert len(errors) == 1 and words in errors[0], (bad, errors)
            assert s.spec().lora_path == str(adapter.resolve())        # the previous adapter is kept
        assert s.configure({"lora": None}) == [] and s.spec().lora_path is None
        assert cfg.Settings().lora is None
    finally:
        s.close()
        eng.close()
