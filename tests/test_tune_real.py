"""`a3b tune` on the real embedded model (SmolLM2-135M, llama), nothing mocked: a few steps on a small
repository with a strong planted regularity, then the adapter through llama.cpp and the runtime."""
from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.slow

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "zeta", "lambda"]


def _planted_repo(root):
    """Twelve modules of handlers that all follow one unusual pattern (and a file .gitignore hides)."""
    rng = random.Random(1)
    for f in range(12):
        lines = ['"""Handlers of the quux registry."""', "from registry import quux_register, quux_emit", ""]
        for _ in range(6):
            w, n = rng.choice(WORDS), rng.randrange(100, 999)
            lines += [f"@quux_register({n})", f"def handle_{w}_{n}(frame):", f"    frame.tag = 'qx-{w}-{n}'",
                      f"    return quux_emit(frame, {n}, '{w}')", ""]
        (root / f"mod{f}.py").write_text("\n".join(lines))
    (root / ".gitignore").write_text("scratch/\n")
    (root / "scratch").mkdir()
    (root / "scratch" / "x.py").write_text("print('not learnt')\n")
    return root


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, default_path):
    from comfyui_a3b.tune.options import TuneConfig
    from comfyui_a3b.tune.run import tune

    d = tmp_path_factory.mktemp("tune")
    repo = d / "repo"
    repo.mkdir()
    _planted_repo(repo)
    cfg = TuneConfig(steps=8, eval_every=8, seq_len=64, batch=2, lr=3e-3, patience=0, device="cpu")
    return tune(repo, default_path, d / "planted.lora.gguf", cfg, bar=False, max_eval_samples=8)


def _llama_logits(base, adapter_path, tokens):
    """All-position logits of `tokens` through llama.cpp, with the adapter set on the context."""
    from comfyui_a3b.runtime.llama import fill_batch, llama, sequence
    from comfyui_a3b.runtime.llama.weights import Weights

    L = llama()
    w = Weights(base)
    p = L.llama_context_default_params()
    p.n_ctx = p.n_batch = p.n_ubatch = 128
    p.n_seq_max = 1
    ctx = L.llama_init_from_model(w.ptr, p)
    batch = L.llama_batch_init(128, 0, 1)
    try:
        if adapter_path:
            ads = (L.llama_adapter_lora_p_ctypes * 1)(w.adapter(str(adapter_path)))
            L.llama_set_adapters_lora(ctx, ads, 1, (ctypes.c_float * 1)(1.0))
        fill_batch(batch, sequence(tokens, 0, all_logits=True))
        assert L.llama_decode(ctx, batch) == 0
        ptr = ctypes.cast(L.llama_get_logits(ctx), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(ptr, shape=(len(tokens), w.n_vocab)).copy()
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        w.free()


def test_held_out_loss_goes_down_and_the_adapter_records_its_making(tuned, default_path):
    from comfyui_a3b.runtime.models import adapters as keys
    from comfyui_a3b.runtime.models.gguf_info import sha256_file
    from comfyui_a3b.tune import adapter

    assert tuned.heldout_files == 3 and tuned.train_files == 9
    assert tuned.heldout_loss < 0.8 * tuned.heldout_loss_base, (tuned.heldout_loss_base, tuned.heldout_loss)
    meta, tensors = adapter.read(tuned.adapter)
    assert meta[keys.BASE_SHA256] == sha256_file(default_path)
    assert meta[keys.HELDOUT] == pytest.approx(tuned.heldout_loss) and meta[keys.REPO].endswith("repo")
    assert '"seed": 0' in meta[keys.SPLIT] and "scratch" not in meta[keys.SPLIT]
    assert len(tensors) == 30 * 7          # every matrix of SmolLM2's 30 blocks


def test_llama_cpp_computes_what_the_torch_forward_with_the_lora_computes(tuned, default_path):
    import torch

    from comfyui_a3b.prune.source import SourceModel
    from comfyui_a3b.runtime.llama.weights import Weights
    from comfyui_a3b.tune import adapter
    from comfyui_a3b.tune.lora import Adapted
    from comfyui_a3b.tune.model import load_base
    from comfyui_a3b.tune.options import TuneConfig

    vocab = Weights(default_path, vocab_only=True)
    tokens = vocab.tokenize("@quux_register(417)\ndef handle_sigma_417(frame):\n    frame.tag = 'qx-sigma-417'\n",
                            add_bos=False, special=False)
    vocab.free()
    with_adapter = _llama_logits(default_path, tuned.adapter, tokens)
    plain = _llama_logits(default_path, None, tokens)
    _, tensors = adapter.read(tuned.adapter)
    model = Adapted(load_base(SourceModel(default_path), "cpu"), TuneConfig().target_list, 8, 16.0, 0.0)
    model.load_tensors(tensors)
    model.eval()
    with torch.no_grad():
        torch_lora = model(torch.tensor([tokens]))[0].numpy()
        model.detach()
        torch_base = model(torch.tensor([tokens]))[0].numpy()
    effect = torch_lora - torch_base                      # what the adapter changes, in torch
    seen = with_adapter - plain                           # what it changes through llama.cpp
    noise = np.abs(plain - torch_base).max()              # quantisation noise: llama.cpp vs torch, no adapter
    assert np.abs(effect).max() > 5 * noise, (np.abs(effect).max(), noise)   # the adapter matters
    assert np.abs(with_adapter - torch_lora).max() < 2 * noise + 0.05 * np.abs(effect).max()
    cos = float((effect * seen).sum() / np.linalg.norm(effect) / np.linalg.norm(seen))
    assert cos > 0.95, cos
    assert (with_adapter.argmax(-1) == torch_lora.argmax(-1)).mean() > 0.9


def test_one_base_serves_requests_with_and_without_the_adapter(tuned, default_path, rt):
    from comfyui_a3b.runtime import TextPrompt, preset

    plain = rt.spec(default_path, n_ctx=256, n_parallel=1)
    lora = rt.spec(default_path, n_ctx=256, n_parallel=1, lora_path=str(tuned.adapter))
    before = rt.store.weight_loads
    prompt = TextPrompt("@quux_register(512)\ndef handle_kappa_512(frame):\n")
    greedy = preset("precise", seed=0, temperature=0.0)
    a = rt.submit(prompt, model=lora, max_tokens=16, sampling=greedy)
    b = rt.submit(prompt, model=plain, max_tokens=16, sampling=greedy)
    ta, tb = a.result().text, b.result().text
    assert rt.store.weight_loads - before <= 1       # the file's weights, loaded at most once for both
    assert rt.loaded(lora) is not rt.loaded(plain)   # a context each
    assert "frame.tag = 'qx-" in ta, ta               # the adapter writes the planted line
    assert ta != tb


def test_an_adapter_is_refused_over_another_base(tuned, tmp_path, rt):
    from comfyui_a3b.runtime.models.adapters import AdapterMismatch
    from tinygguf import write_tiny_gguf

    other = write_tiny_gguf(tmp_path / "other.gguf", "llama")    # the same architecture, another file
    spec = rt.spec(str(other), n_ctx=64, n_parallel=1, lora_path=str(tuned.adapter))
    with pytest.raises(AdapterMismatch, match="was trained for SmolLM2-135M-Instruct.Q4_1.gguf"):
        rt.submit("x", model=spec, max_tokens=1).result()
