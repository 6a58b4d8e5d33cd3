"""Crafted LoRA adapters and projectors never abort the process that uses them.

llama.cpp reads an adapter's `adapter.lora.alpha` with gguf_get_val_f32, which aborts the process on
a string; a projector with a head count of 0 loads and aborts at its first image encode. Adapters
are checked in Python (header bounded, each key llama.cpp reads type-checked), then tried over their
base in the vetting child; projectors are tried over their text model, encoding a small image.
Every case that could kill a process runs in a subprocess of its own: the test fails if it dies.
"""
from __future__ import annotations

import asyncio
import base64
import os
import re
import subprocess
import sys
import textwrap

import httpx
import numpy as np
import pytest
import pytest_asyncio
from lsprotocol import types as T
from pytest_lsp import ClientServerConfig, client_capabilities

from comfyui_a3b.bench.mmproj import SHAPES, write_mmproj
from comfyui_a3b.runtime.models import adapters
from comfyui_a3b.runtime.errors import CorruptGGUF, TruncatedGGUF

from lsp_helpers import SERVER, configure, inline, open_doc, status
from tinygguf import patched_copy, truncated_copy, write_tiny_gguf, write_tiny_lora

ENV = {"GGML_NO_BACKTRACE": "1"}


def write_lora(path, kv: dict | None = None, *, alpha=True, seed: int = 1):
    """write_tiny_lora's adapter with metadata `kv` ({key: (value, gguf.GGUFValueType)}) added or
    put in place of alpha."""
    import gguf

    rng = np.random.default_rng(seed)
    kv = dict(kv or {})
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    if alpha and "adapter.lora.alpha" not in kv:
        w.add_float32("adapter.lora.alpha", 4.0)
    for k, (v, t) in kv.items():
        if t == gguf.GGUFValueType.ARRAY:
            w.add_array(k, v)
        else:
            w.add_key_value(k, v, t)
    for i in range(2):
        for name, n_out in (("attn_q", 64), ("attn_v", 32)):
            w.add_tensor(f"blk.{i}.{name}.weight.lora_a", (rng.standard_normal((4, 64)) * 0.5).astype(np.float32))
            w.add_tensor(f"blk.{i}.{name}.weight.lora_b", (rng.standard_normal((n_out, 4)) * 0.5).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _wrong_types():
    import gguf

    V = gguf.GGUFValueType
    return {"adapter.lora.alpha": ("4", V.STRING), "general.type": (7, V.UINT32),
            "adapter.type": (1.0, V.FLOAT32), "adapter.lora.task_name": (3, V.INT32),
            "adapter.lora.prompt_prefix": (True, V.BOOL), "adapter.alora.invocation_tokens": (5, V.UINT32),
            "general.alignment": (32, V.UINT64)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("vet")
    (d / "models").mkdir()
    base = write_tiny_gguf(d / "models" / "tiny.gguf", "llama")
    loras = d / "loras"
    loras.mkdir()
    good = write_tiny_lora(loras / "good.lora.gguf")
    string_alpha = {"adapter.lora.alpha": _wrong_types()["adapter.lora.alpha"]}
    out = {"base": base, "good": good, "string_alpha": write_lora(loras / "string-alpha.lora.gguf", string_alpha),
           "truncated": truncated_copy(good, loras / "truncated.lora.gguf", 0.5),
           "tensors_2e40": patched_copy(good, loras / "tensors.lora.gguf", {"tensor_count": 1 << 40}),
           "keys_2e40": patched_copy(good, loras / "keys.lora.gguf", {"kv_count": 1 << 40})}
    out["dir"], out["loras"] = d, loras
    return out


BAD = ("string_alpha", "truncated", "tensors_2e40", "keys_2e40")
WORDS = {"string_alpha": "adapter.lora.alpha is stored as str, not f32", "truncated": "is truncated",
         "tensors_2e40": "1099511627776 tensors", "keys_2e40": "1099511627776 entries"}


# -- the checks in Python (nothing here reaches llama.cpp) -----------------------------------------------
@pytest.mark.parametrize("key", list(_wrong_types()))
def test_each_key_llama_cpp_reads_is_type_checked_naming_it(tmp_path, key):
    bad = write_lora(tmp_path / "bad.gguf", {key: _wrong_types()[key]})
    with pytest.raises((CorruptGGUF, adapters.AdapterMismatch)) as e:
        adapters.read_meta(bad)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_cut_files_and_absurd_counts_are_one_line_errors_not_tracebacks(files):
    for name in ("truncated", "tensors_2e40", "keys_2e40"):
        with pytest.raises((TruncatedGGUF, CorruptGGUF)) as e:
            adapters.check(files[name], files["base"])
        assert WORDS[name] in str(e.value) and "\n" not in str(e.value)
    assert adapters.check(files["good"], files["base"])["adapter.type"] == "lora"


def test_a_tensor_whose_extra_dimensions_do_not_fit_the_base_is_refused(tmp_path, files):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 4.0)
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((2, 4, 64), np.float32))
    w.add_tensor("blk.0.attn_q.weight.lora_b", np.zeros((2, 64, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(adapters.AdapterMismatch, match=r"'blk.0.attn_q.weight.lora_a' has the shape \[64, 4, 2\]"):
        adapters.check(tmp_path / "a.gguf", files["base"])


# -- each surface, in a process of its own ---------------------------------------------------------------
def _run(args, tmp_path, timeout=120, **env):
    return subprocess.run([sys.executable, "-m", "comfyui_a3b.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **ENV, "A3B_CACHE": str(tmp_path / "cache"), **env})


def _one_error_line(p) -> str:
    assert p.returncode == 2 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-3000:])
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("a3b: error:")]
    assert len(lines) == 1, p.stderr
    return lines[0]


@pytest.mark.parametrize("name", BAD)
@pytest.mark.parametrize("vetting", ["on", "off"])
def test_a3b_generate_with_a_bad_adapter_exits_2_with_one_line(files, tmp_path, name, vetting):
    p = _run(["generate", "Hi", "--model", str(files["base"]), "--lora", str(files[name]), "--max-tokens", "2",
              "--n-ctx", "128"], tmp_path, A3B_VET=vetting)
    assert WORDS[name] in _one_error_line(p)


CHILD_ONLY = textwrap.dedent("""
    import sys
    from comfyui_a3b.runtime.models import vet
    try:
        vet.check_adapter(sys.argv[1], sys.argv[2])
    except vet.CorruptGGUF as e:
        print("REFUSED", e)
    else:
        print("PASSED")
""")


def test_the_child_catches_what_the_python_checks_would_miss(files, tmp_path):
    """The string alpha straight to the vetting child (the Python checks left out): llama.cpp's abort
    happens there, and this process reads it as a refusal naming llama.cpp's assertion."""
    env = {**os.environ, **ENV, "A3B_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-c", CHILD_ONLY, str(files["string_alpha"]), str(files["base"])],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "REFUSED" in p.stdout and "LoRA adapter" in p.stdout and "GGML_ASSERT" in p.stdout, p.stdout
    ok = subprocess.run([sys.executable, "-c", CHILD_ONLY, str(files["good"]), str(files["base"])],
                        capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0 and "PASSED" in ok.stdout, ok.stdout + ok.stderr[-2000:]
    # the verdict is kept: a new process asks the child no more
    again = subprocess.run([sys.executable, "-c", CHILD_ONLY + "print(vet.history)", str(files["string_alpha"]),
                            str(files["base"])], capture_output=True, text=True, timeout=120, env=env)
    assert "REFUSED" in again.stdout and again.stdout.rstrip().endswith("[]"), again.stdout


@pytest.mark.parametrize("name", ["string_alpha", "truncated"])
def test_a3b_serve_with_a_bad_adapter_stops_at_start_up_with_one_line(files, tmp_path, name):
    p = _run(["serve", "--model", str(files["base"]), "--lora", str(files[name]), "--http", "127.0.0.1:0",
              "--n-ctx", "128"], tmp_path)
    assert WORDS[name] in _one_error_line(p)


def png_data_url() -> str:
    from comfyui_a3b.runtime.images import RGBImage, png_bytes

    px = np.random.default_rng(0).integers(0, 256, (6, 8, 3), dtype=np.uint8).tobytes()
    return "data:image/png;base64," + base64.b64encode(png_bytes(RGBImage(8, 6, px, ""))).decode()


def bad_projector(path):
    s = dict(SHAPES["tiny-mlp"])
    s["n_head"] = 0   # clip.vision.attention.head_count 0: loads, and aborts at the first encode
    return write_mmproj(path, 64, s)


def test_a_projector_that_aborts_at_its_first_encode_is_found_by_the_trial(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    bad = bad_projector(tmp_path / "elsewhere-mmproj.gguf")
    p = _run(["generate", "Hi", "--model", str(model), "--mmproj", str(bad), "--max-tokens", "2", "--n-ctx", "128"],
             tmp_path)
    line = _one_error_line(p)
    assert "encode a small image" in line and "GGML_ASSERT" in line, line


def test_serve_with_a_bad_projector_beside_the_model_answers_images_with_an_error_and_stays_up(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    model = write_tiny_gguf(d / "tiny.gguf", "llama")
    bad_projector(d / "mmproj-tiny.gguf")
    env = {**os.environ, **ENV, "A3B_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "comfyui_a3b.cli", "serve", "--model", str(model), "--http",
                             "127.0.0.1:0", "--n-ctx", "256", "--quiet"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, said = None, []
        for line in proc.stderr:
            said.append(line)
            m = re.search(r" on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "".join(said)
        assert any("was not loaded" in ln and "encode a small image" in ln for ln in said), "".join(said)
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
            image = {"type": "image_url", "image_url": {"url": png_data_url()}}
            content = [{"type": "text", "text": "Describe"}, image]
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and "mmproj" in r.text, r.text
            r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
            assert r.status_code == 200, r.text
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)


# -- the language server ------------------------------------------------------------------------------
@pytest_asyncio.fixture(loop_scope="function")
async def lsp(files, tmp_path):
    env = {**os.environ, **ENV, "A3B_CACHE": str(tmp_path / "cache"), "A3B_LORAS": str(files["loras"]),
           "A3B_MODELS": str(files["base"].parent)}
    c = await ClientServerConfig(server_command=SERVER + ["--model", str(files["base"]),
                                                          "--stdio"], server_env=env).start(devtools=None)
    await c.initialize_session(T.InitializeParams(capabilities=client_capabilities("visual-studio-code"),
                                                  initialization_options={"a3b": {"debounceMs": 0}}))
    yield c
    await c.shutdown_session()
    await c.stop()


async def test_the_language_server_survives_a_bad_adapter_setting_and_says_why(lsp, files):
    uri = "file:///w/a.py"
    open_doc(lsp, uri, "def add(a, b):\n    return ")
    n = len(lsp.messages)
    await configure(lsp, lora=str(files["string_alpha"]))
    assert (await status(lsp))["settings"]["lora"] == str(files["string_alpha"])
    try:
        await inline(lsp, uri, T.Position(1, 11))
    except Exception as e:  # noqa: BLE001 - an error answer is one way of saying it
        said = [str(e)]
    else:
        said = []
    for _ in range(40):
        said += [m.message for m in lsp.messages[n:]]
        if any("adapter.lora.alpha" in m for m in said):
            break
        await asyncio.sleep(0.25)
    assert any("adapter.lora.alpha" in m for m in said), said
    # alive, and a good adapter works after it
    await configure(lsp, lora=str(files["good"]))
    await inline(lsp, uri, T.Position(1, 11))
    assert (await status(lsp))["settings"]["lora"] == str(files["good"])
    # outside the LoRA folders: refused by the setting itself
    await configure(lsp, lora=str(files["base"]))
    assert any("outside the LoRA folders" in m.message for m in lsp.messages[n:])
    assert (await status(lsp))["settings"]["lora"] == str(files["good"])


