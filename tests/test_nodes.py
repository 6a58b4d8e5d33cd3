"""The node contract without ComfyUI: schemas, execution, cache keys, interruption and every bad input
the nodes must refuse with a clear message.

Execution tests run twice: over the fake engine (fast tier) and on the real embedded model (`slow`).
Tests of what only a real model can show (retrieval quality, a stop string it really writes) are
slow only."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import comfyui_a3b
from comfyui_a3b.nodes import core, defs, embeddings, generation
from comfyui_a3b.nodes.v1 import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, input_types
from comfyui_a3b.runtime import LoadSpec, add_model_dir, get_runtime
from comfyui_a3b.runtime.errors import (Cancelled, InvalidRequest, ModelNotFound, PathNotAllowed,
                                        PromptTooLong)

from node_helpers import GEN, generate, loader_args, node

@pytest.fixture(scope="module", params=["fake://nodes?delay_ms=1",
                                        pytest.param(core.DEFAULT_CHOICE, marks=pytest.mark.slow)],
                ids=["fake", "real"])
def model_choice(request, fake_engine):
    return request.param


@pytest.fixture(scope="module")
def handle(model_choice):
    return node("A3BLoader").run(unique_id="1", **loader_args(model_choice))["result"][0]


@pytest.fixture(scope="module")
def real_handle():
    return node("A3BLoader").run(unique_id="1", **defs.LOADER.defaults())["result"][0]


def test_pack_exports_v1_mappings_outside_comfyui():
    assert comfyui_a3b.NODE_CLASS_MAPPINGS is NODE_CLASS_MAPPINGS
    assert set(NODE_CLASS_MAPPINGS) == {"A3BLoader", "A3BPrune", "A3BRouter", "A3BGenerate", "A3BEmbed", "A3BTopK",
                                     "A3BUnload"}
    assert comfyui_a3b.WEB_DIRECTORY == "./web"
    assert "comfy" not in sys.modules and "folder_paths" not in sys.modules  # no ComfyUI import
    assert all(NODE_DISPLAY_NAME_MAPPINGS[k].startswith("A3B ") for k in NODE_CLASS_MAPPINGS)


def test_generate_schema_matches_the_issue():
    it = input_types(defs.GENERATE)
    req = it["required"]
    assert req["model"] == ("A3B_MODEL", {})
    assert req["max_new_tokens"][1]["default"] == 512
    assert req["temperature"][1]["default"] == 0.4
    for name in ("top_p", "top_k", "min_p", "repeat_penalty", "stop", "system", "confidence_aware"):
        assert name in req
    assert req["seed"][0] == "INT" and req["seed"][1]["control_after_generate"] is True
    assert req["prompt"][1]["multiline"] is True
    assert it["optional"]["context"][1]["forceInput"] is True
    assert it["hidden"] == {"unique_id": "UNIQUE_ID"}
    cls = NODE_CLASS_MAPPINGS["A3BGenerate"]
    # the reasoning output comes last: saved workflows keep their links to text and spans
    assert cls.RETURN_TYPES == ("STRING", "STRING", "STRING") and cls.OUTPUT_NODE is True
    assert cls.RETURN_NAMES[2] == "reasoning"
    opt = it["optional"]
    assert opt["thinking"][0] == ["auto", "on", "off"] and opt["thinking"][1]["default"] == "auto"
    assert opt["reasoning_budget"][1]["default"] == -1 and opt["json_schema"][1]["multiline"] is True
    assert cls.FUNCTION == "run" and not hasattr(cls, "IS_CHANGED")  # cached on its inputs


def test_loader_embed_topk_unload_schemas():
    lt = input_types(defs.LOADER)
    assert lt["required"]["model"][0][0] == core.DEFAULT_CHOICE  # a dropdown, default first
    assert list(lt["required"]) == ["model", "n_ctx", "n_gpu_layers"]   # what loading needs
    advanced = [k for k, (_, o) in lt["optional"].items() if o.get("advanced")]
    assert [k for k in lt["optional"] if k not in advanced] == ["mmproj", "lora", "lora_strength"]
    assert {"threads", "flash_attn", "kv_cache_type", "cpu_moe", "speculative"} <= set(advanced)
    assert lt["required"]["n_ctx"][1]["min"] % lt["required"]["n_ctx"][1]["step"] == 0  # 2048 stays 2048
    assert not {"keep_ratio", "prune_method", "recover_steps", "heads_keep", "experts_keep"} & set(lt["optional"])
    pt = input_types(defs.PRUNE)
    assert list(pt["required"]) == ["model", "keep_ratio", "prune_method", "recover_steps", "heads_keep",
                                    "experts_keep"]
    assert pt["required"]["keep_ratio"][1]["default"] == 1.0
    assert NODE_CLASS_MAPPINGS["A3BPrune"].RETURN_TYPES == ("A3B_MODEL",)
    assert NODE_CLASS_MAPPINGS["A3BLoader"].RETURN_TYPES == ("A3B_MODEL",)
    emb = NODE_CLASS_MAPPINGS["A3BEmbed"]
    assert emb.INPUT_IS_LIST is True and emb.RETURN_TYPES == ("EMBEDDINGS", "STRING")
    assert emb.OUTPUT_IS_LIST == (False, True)
    assert input_types(defs.EMBED)["required"]["pooling"][0] == ["mean", "cls", "last"]
    assert NODE_CLASS_MAPPINGS["A3BTopK"].INPUT_IS_LIST is True
    un = NODE_CLASS_MAPPINGS["A3BUnload"]
    assert un.OUTPUT_NODE is True and un.NOT_IDEMPOTENT is True
    v = un.IS_CHANGED()
    assert v != v  # NaN: never equal, so it runs every time


def test_model_folder_files_appear_in_the_dropdown(tmp_path, default_path):
    d = tmp_path / "LLM"
    d.mkdir()
    os.symlink(default_path, d / "mine.gguf")
    add_model_dir(d)
    assert "mine.gguf" in input_types(defs.LOADER)["required"]["model"][0]


# -- execution ------------------------------------------------------------------------------------------
def test_loader_twice_does_not_reload(rt, handle, model_choice):
    loads = rt.store.weight_loads
    t0 = time.perf_counter()
    again = node("A3BLoader").run(unique_id="1", **loader_args(model_choice))["result"][0]
    assert time.perf_counter() - t0 < 0.5
    assert again == handle and isinstance(again, LoadSpec)
    assert rt.store.weight_loads == loads


def test_generate_is_deterministic_per_seed_and_streams(handle):
    seen: list[str] = []
    hooks = generation.GenerateHooks(on_text=lambda t, n: seen.append(t))
    g = generation.generate(handle, "Write one sentence about the moon.", max_new_tokens=24,
                      sampling=generation.sampling_params(seed=11, temperature=1.0), hooks=hooks)
    assert g.text and "".join(seen) == g.text
    out = generate(handle, "Write one sentence about the moon.", seed=11, temperature=1.0)
    assert out["result"][0] == g.text and out["ui"] == {"text": [g.text]}
    texts = {generate(handle, "Write one sentence about the moon.", seed=s, temperature=1.0)["result"][0]
             for s in (1, 2, 3)}
    assert len(texts | {g.text}) > 1  # the seed reaches the sampler


@pytest.mark.slow
def test_generate_context_system_stop_and_spans(real_handle):
    handle = real_handle
    free = generate(handle, "List five fruits.", max_new_tokens=24, temperature=0.0)["result"][0]
    stop = free.split()[2]  # a word the model really writes
    cut = generate(handle, "List five fruits.", max_new_tokens=24, temperature=0.0,
                   stop=f"nothing-like-this\n{stop}")["result"][0]
    assert cut == free[:free.index(stop)]
    text, spans, reasoning = generate(handle, "Invent a word and define it.", max_new_tokens=32, temperature=1.3,
                                      confidence_aware=True, confidence_threshold=0.5)["result"]
    assert reasoning == ""   # the embedded model does not think
    spans = json.loads(spans)
    assert spans and all({"start", "end", "text", "mean_entropy"} <= set(s) for s in spans)
    assert "requires verification" in text  # marked in the text
    story = "Panel 1: a robot finds a red umbrella on a rainy street."
    out = generate(handle, "What colour is the umbrella? Answer in one word.", context=story,
                   temperature=0.0, max_new_tokens=8)["result"][0]
    assert "red" in out.lower()


def test_cancel_between_tokens_keeps_partial_and_model_clean(handle):
    seen: list[int] = []
    hooks = generation.GenerateHooks(on_text=lambda t, n: seen.append(n), should_stop=lambda: len(seen) >= 4)
    with pytest.raises(Cancelled) as ei:
        generation.generate(handle, "Write a long essay about rivers.", max_new_tokens=400,
                      sampling=generation.sampling_params(temperature=0.0), hooks=hooks)
    partial = ei.value.partial
    assert 4 <= partial.n_tokens < 60 and partial.finish_reason == "cancelled"
    assert generate(handle, "Say hi.", max_new_tokens=4)["result"][0]


def test_embed_outputs_a_tensor_and_the_texts(handle):
    emb, texts = node("A3BEmbed").run(unique_id=["3"], model=[handle], text=["one\n\n two \nthree"], pooling=["mean"],
                                      normalize=[True])["result"]
    import torch

    assert isinstance(emb, torch.Tensor) and emb.dtype == torch.float32 and emb.shape[0] == 3
    assert texts == ["one", "two", "three"]
    assert np.allclose(emb.norm(dim=1).numpy(), 1.0, atol=1e-5)
    # a connected list of STRING works like lines
    emb2, texts2 = node("A3BEmbed").run(unique_id=["6"], model=[handle], text=texts, pooling=["mean"],
                                        normalize=[True])["result"]
    assert texts2 == texts and np.allclose(emb2.numpy(), emb.numpy(), atol=2e-3)


@pytest.mark.slow
def test_embed_topk_retrieves_by_meaning(real_handle):
    handle = real_handle
    docs = "The cat sat on the mat.\nStock markets fell sharply today.\nA kitten slept on the rug.\n"
    emb, texts = node("A3BEmbed").run(unique_id=["3"], model=[handle], text=[docs], pooling=["mean"],
                                      normalize=[True])["result"]
    import torch

    assert isinstance(emb, torch.Tensor) and tuple(emb.shape) == (3, 576) and emb.dtype == torch.float32
    assert texts == ["The cat sat on the mat.", "Stock markets fell sharply today.", "A kitten slept on the rug."]
    q = node("A3BEmbed").run(unique_id=["4"], model=[handle], text=["Where did the cat sit?"],
                             pooling=["mean"], normalize=[True])["result"][0]
    context, scores = node("A3BTopK").run(unique_id=["5"], documents=[emb], texts=texts, query=[q], top_k=[2],
                                          separator=["\\n"])["result"]
    assert context.split("\n")[0] == texts[0] and "Stock" not in context
    assert len(scores.splitlines()) == 2


def test_unload_node_then_handle_reloads(rt, handle):
    rt.load(handle)
    out = node("A3BUnload").run(unique_id="7", model=handle, passthrough="keep me")
    assert out["result"] == ("keep me",) and rt.store.entry(handle) is None
    assert generate(handle, "Say hi.", max_new_tokens=4)["result"][0]  # the handle survives an unload
    assert rt.store.entry(handle) is not None
    node("A3BUnload").run(unique_id="7")  # nothing connected: every model
    assert rt.store.loaded() == []


# -- bad input --------------------------------------------------------------------------------------------
def test_unknown_model_name_is_refused():
    with pytest.raises(ModelNotFound, match="no-such-model.gguf"):
        node("A3BLoader").run(unique_id="1", **{**defs.LOADER.defaults(), "model": "no-such-model.gguf"})


def test_path_outside_model_folders_refused_without_reading(tmp_path):
    fifo = tmp_path / "evil.gguf"
    os.mkfifo(fifo)  # opening it for reading would block: the refusal must come first
    for ref in (str(fifo), "../../../../../../" + str(fifo).lstrip("/")):
        with pytest.raises(PathNotAllowed, match="outside the allowed model folders"):
            node("A3BLoader").run(unique_id="1", **{**defs.LOADER.defaults(), "model": ref})


def test_empty_prompt(handle):
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        generate(handle, "   ")


def test_max_new_tokens_beyond_context_ends_at_the_context(rt, model_choice, caplog):
    """The runtime's rule (generation.cut_by_context): max_new_tokens beyond the room is not refused;
    the answer ends at the context's end, and the node says so, in the CLI's words."""
    small = node("A3BLoader").run(unique_id="1", **loader_args(model_choice, n_ctx=256))["result"][0]
    endless = generation.sampling_params(ignore_eos=True)
    g = generation.generate(small, "Tell a story.", max_new_tokens=1000, sampling=endless)
    res = g.result
    assert res.finish_reason == "length" and res.context_full
    assert res.n_prompt_tokens + res.n_tokens == 256
    assert g.note.startswith("the answer stopped because the context is full ("
                             f"{res.n_prompt_tokens} prompt + {res.n_tokens} answer tokens of n_ctx 256), before "
                             "max_new_tokens; raise n_ctx for a longer answer."), g.note
    assert g.ui["note"] == [g.note] and g.note in caplog.text
    g = generation.generate(small, "Tell a story.", max_new_tokens=8, sampling=endless)
    assert (g.result.finish_reason, g.result.context_full, g.note) == ("length", False, "")   # max_new_tokens
    with pytest.raises(PromptTooLong, match="raise n_ctx in A3BLoader"):   # no room at all: refused
        generate(small, "word " * 400, max_new_tokens=8)
    assert node("A3BGenerate").run(unique_id="2", model=small, prompt="Tell a story.",
                                   **{**GEN, "max_new_tokens": 1000})["result"][0]   # the node runs it too
    rt.unload(small)


def test_embed_refuses_non_text_items_and_empty(handle):
    with pytest.raises(InvalidRequest, match="Item #1 .* int"):
        node("A3BEmbed").run(unique_id=["3"], model=[handle], text=["ok", 3], pooling=["mean"], normalize=[True])
    with pytest.raises(InvalidRequest, match="empty"):
        node("A3BEmbed").run(unique_id=["3"], model=[handle], text=["\n  \n"], pooling=["mean"], normalize=[True])


def test_topk_mismatch_errors(handle):
    emb = embeddings.to_tensor(np.eye(3, dtype=np.float32))
    with pytest.raises(InvalidRequest, match="3 document embeddings but 2 texts"):
        embeddings.top_k(emb, ["a", "b"], emb[:1], 1)
    with pytest.raises(InvalidRequest, match="dimensions"):
        embeddings.top_k(emb, ["a", "b", "c"], np.ones((1, 5)), 1)


def test_handle_type_checked():
    with pytest.raises(core.NodeError, match="A3BLoader"):
        generation.generate("not a handle", "hi")  # type: ignore[arg-type]


def test_gpu_layers_on_a_cpu_build_says_how_to_fix():
    from comfyui_a3b.runtime.llama import system_info

    if system_info()["gpu_offload"]:
        pytest.skip("this llama-cpp-python has GPU offload; the CPU-only refusal does not apply")
    with pytest.raises(InvalidRequest, match="built for the CPU only. Use n_gpu_layers 0"):
        node("A3BLoader").run(unique_id="1", **{**defs.LOADER.defaults(), "n_gpu_layers": 10})
    # auto (the default) means the CPU here, with the reason in the model's status
    h = node("A3BLoader").run(unique_id="1", **defs.LOADER.defaults())["result"][0]
    assert h.n_gpu_layers == "auto" and get_runtime().load(h).info.n_gpu_layers == 0


@pytest.mark.slow
def test_model_replaced_on_disk_changes_key_and_reloads(rt, tmp_path, default_path, tiny_models):
    d = tmp_path / "models"
    d.mkdir()
    target = d / "swap.gguf"
    shutil.copy(default_path, target)
    add_model_dir(d)
    args = {**defs.LOADER.defaults(), "model": "swap.gguf"}
    key1 = defs.LOADER.fingerprint_of(**args)
    h = node("A3BLoader").run(unique_id="1", **args)["result"][0]
    assert defs.LOADER.fingerprint_of(**args) == key1  # unchanged file: ComfyUI keeps its cache
    first = rt.load(h)
    vocab = first.info.n_vocab
    loads = rt.store.weight_loads
    shutil.copy(tiny_models["llama"], target)  # another model under the same name
    os.utime(target, ns=(time.time_ns(), time.time_ns()))
    assert defs.LOADER.fingerprint_of(**args) != key1  # ComfyUI re-runs the loader and its dependents
    out = generate(h, "Say hi.", max_new_tokens=4)["result"][0]
    assert isinstance(out, str)
    assert rt.store.weight_loads == loads + 1
    assert rt.load(h) is not first and rt.load(h).info.n_vocab != vocab  # really the new file
    rt.unload(h)


def test_broken_llama_cpp_gives_one_clear_line_and_node_error(tmp_path):
    shadow = tmp_path / "shadow" / "llama_cpp"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise OSError('libllama.so: cannot open shared object file')\n")
    code = textwrap.dedent("""
        import logging, comfyui_a3b
        from comfyui_a3b.nodes.v1 import NODE_CLASS_MAPPINGS
        from comfyui_a3b.nodes import defs
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        comfyui_a3b._check_llama_cpp()
        try:
            NODE_CLASS_MAPPINGS["A3BLoader"]().run(unique_id="1", **defs.LOADER.defaults())
        except Exception as e:
            print("NODE ERROR", type(e).__name__, e)
    """)
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    log_lines = [ln for ln in p.stderr.splitlines() if "comfyui-a3b" in ln]
    assert len(log_lines) == 1 and "pip install llama-cpp-python" in log_lines[0], p.stderr
    assert "NODE ERROR LlamaCppUnavailable" in p.stdout and "pip install" in p.stdout, p.stdout


@pytest.mark.slow
def test_second_import_copy_shares_one_runtime(tmp_path):
    """ComfyUI imports the pack under its folder path, dots replaced (nodes.py's load_custom_node);
    that copy must use the same runtime, wherever the pack is installed (site-packages has dots)."""
    root = os.path.dirname(comfyui_a3b.__file__)
    code = textwrap.dedent(f"""
        import importlib.util, sys
        import comfyui_a3b.runtime as canonical
        name = {root.replace(".", "_x_")!r}
        spec = importlib.util.spec_from_file_location(name, {os.path.join(root, "__init__.py")!r},
                                                      submodule_search_locations=[{root!r}])
        mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
        loader = mod.NODE_CLASS_MAPPINGS["A3BLoader"]
        from comfyui_a3b.nodes import defs
        loader().run(unique_id="1", **defs.LOADER.defaults())
        rt = canonical.get_runtime()
        print(mod.NODE_CLASS_MAPPINGS is not None, rt.store.weight_loads, len(rt.store.loaded()))
        print(sys.modules[name + ".runtime"] is canonical)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "1", "1", "True"], p.stdout + p.stderr


@pytest.mark.slow
def test_loader_serves_a_reencoded_copy(rt, tmp_path, monkeypatch):
    monkeypatch.setenv("A3B_CACHE", str(tmp_path / "cache"))
    assert "q8_0" in input_types(defs.LOADER)["optional"]["serve_as"][0]
    h = node("A3BLoader").run(unique_id="1",
                              **{**defs.LOADER.defaults(), "serve_as": "q8_0", "n_ctx": 512})["result"][0]
    assert h.serve_as == "q8_0"
    assert [e for e in rt.store.loaded() if e.spec == h]
    assert list((tmp_path / "cache").rglob("*.gguf"))  # the copy was made once, in the cache
    assert generate(h, "Say hi.", max_new_tokens=4)["result"][0]
    rt.unload(h)


def test_lora_from_the_lora_folder(rt, tmp_path, monkeypatch, tiny_models):
    from tinygguf import write_tiny_lora

    loras = tmp_path / "loras"
    loras.mkdir()
    write_tiny_lora(loras / "adapter.gguf")
    (tmp_path / "outside.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("A3B_LORAS", str(loras))
    add_model_dir(tiny_models["llama"].parent)
    assert "adapter.gguf" in input_types(defs.LOADER)["optional"]["lora"][0]
    base_args = {**defs.LOADER.defaults(), "model": tiny_models["llama"].name, "n_ctx": 128}
    base = node("A3BLoader").run(unique_id="1", **base_args)["result"][0]
    loads = rt.store.weight_loads
    tuned = node("A3BLoader").run(unique_id="1", **{**base_args, "lora": "adapter.gguf"})["result"][0]
    assert tuned.lora_path == str(loras / "adapter.gguf") and rt.store.weight_loads == loads  # same weights
    greedy = dict(temperature=0.0, max_new_tokens=6)
    assert generate(base, "the x", **greedy)["result"][0] != generate(tuned, "the x", **greedy)["result"][0]
    for bad in ("missing.gguf", "../outside.gguf"):
        with pytest.raises(core.NodeError, match="LoRA adapter"):
            node("A3BLoader").run(unique_id="1", **{**base_args, "lora": bad})
    rt.unload(base)
    rt.unload(tuned)


def test_a_missing_model_names_the_default_as_the_dropdown_shows_it(tmp_path, monkeypatch):
    monkeypatch.setenv("A3B_MODELS", str(tmp_path))
    with pytest.raises(ModelNotFound) as e:
        node("A3BLoader").run(unique_id="1", **{**defs.LOADER.defaults(), "model": "nope.gguf"})
    assert f"{core.DEFAULT_CHOICE!r}" in str(e.value) and core.DEFAULT_CHOICE in core.model_choices()
    assert "'default'" not in str(e.value)


def test_the_in_process_language_server_start_is_one_line_with_its_address(monkeypatch, caplog):
    import logging

    from comfyui_a3b.lsp_server import inprocess

    monkeypatch.setenv("A3B_LSP", "tcp:127.0.0.1:0")
    try:
        with caplog.at_level(logging.INFO, logger="a3b"):
            comfyui_a3b._start_language_server()
        address = inprocess.status()["address"]
    finally:
        inprocess.stop()
    said = [r.getMessage() for r in caplog.records if "language server" in r.getMessage()]
    assert said == [f"[comfyui-a3b] language server listening on {address}"], said



