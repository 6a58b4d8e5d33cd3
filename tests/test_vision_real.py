"""Images in on real llama.cpp (libmtmd), with tiny random projectors the tests write (bench/mmproj.py):
an LLaVA-style `mlp` projector over a llama text model and Qwen2-VL's `qwen2vl_merger` (M-RoPE) over a
qwen2vl one. Nothing is mocked: the projector loads beside the model, images change what the model
computes (deterministically), the embedding cache and the KV cache spare a re-queued image its encode,
a corrupt projector is refused after a trial in a child process, and every bad pairing says why.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from comfyui_a3b.bench.mmproj import SHAPES, write_mmproj
from comfyui_a3b.runtime import Runtime, preset
from comfyui_a3b.runtime.errors import CorruptGGUF, ModelLoadFailed, ModelNotFound, PromptTooLong
from comfyui_a3b.runtime.requests import ChatPrompt, ImagePart
from tinygguf import rewritten_copy, write_tiny_gguf

pytestmark = pytest.mark.slow

PAIRS = {"mlp": ("llama", "tiny-mlp"), "qwen2vl": ("qwen2vl", "tiny-qwen2vl")}


def image(seed: int, w: int = 40, h: int = 30) -> ImagePart:
    px = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return ImagePart(rgb=px.tobytes(), width=w, height=h)


def chat(*content) -> ChatPrompt:
    return ChatPrompt([{"role": "user", "content": tuple(content)}])


@pytest.fixture(scope="module")
def rt():
    r = Runtime()
    yield r
    r.unload()


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request, tmp_path_factory):
    arch, proj = PAIRS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    model = write_tiny_gguf(d / f"tiny-{arch}.gguf", arch, n_ctx=1024)
    write_mmproj(d / f"mmproj-tiny-{arch}-f32.gguf", 64, proj)
    return request.param, model


def spec_of(rt, model, **kw):
    return rt.spec(str(model), n_gpu_layers=0, **{"n_ctx": 512, "n_parallel": 2, **kw})


def test_the_projector_beside_the_model_loads_and_images_change_the_output(rt, pair):
    kind, model = pair
    spec = spec_of(rt, model)
    m = rt.load(spec)
    assert m.features.get("vision") is True and m.features["projector"].startswith("mmproj-tiny")
    assert m.vision.info.mrope is (kind == "qwen2vl")
    greedy = preset("greedy")
    a = rt.generate(chat("Describe ", image(1), " now."), model=spec, max_tokens=8, sampling=greedy)
    a2 = rt.generate(chat("Describe ", image(1), " now."), model=spec, max_tokens=8, sampling=greedy)
    none = rt.generate(chat("Describe  now."), model=spec, max_tokens=8, sampling=greedy)
    assert a.tokens == a2.tokens
    assert a.n_prompt_tokens > none.n_prompt_tokens + 4, "the image's tokens are part of the prompt"
    # sampled with a seed: the same image and seed give the same text
    s1 = rt.generate(chat(image(3), "Tell."), model=spec, max_tokens=10, sampling=preset("creative", seed=5))
    s2 = rt.generate(chat(image(3), "Tell."), model=spec, max_tokens=10, sampling=preset("creative", seed=5))
    assert s1.text == s2.text


def test_other_images_give_other_logits(rt, pair):
    """What the model computes after the image depends on the image: the first token's distribution."""
    _, model = pair
    spec = spec_of(rt, model)
    tops = []
    for seed in (11, 12, 11):
        first: list = []
        rt.generate(chat(image(seed), "Next?"), model=spec, max_tokens=1, sampling=preset("greedy"), logprobs=5,
                    on_token=first.append)
        first = [ev.top_logprobs for ev in first]
        tops.append(tuple((t, round(lp, 4)) for t, lp in first[0]))
    assert tops[0] != tops[1] and tops[0] == tops[2]


def test_a_requeued_image_is_not_encoded_again(rt, pair):
    _, model = pair
    spec = spec_of(rt, model, n_parallel=1)
    v = rt.load(spec).vision
    prompt = chat("Caption: ", image(21))
    rt.generate(prompt, model=spec, max_tokens=3, sampling=preset("creative", seed=1))
    enc = v.stats["encoded"]
    again = rt.generate(prompt, model=spec, max_tokens=3, sampling=preset("creative", seed=2))
    assert v.stats["encoded"] == enc and again.n_cached_prompt_tokens > 16   # its KV cache was reused
    rt.generate("other text " * 20, model=spec, chat=False, max_tokens=2)   # the slot now holds other tokens
    hits = v.stats["cache_hits"]
    rt.generate(prompt, model=spec, max_tokens=3, sampling=preset("creative", seed=3))
    assert v.stats["encoded"] == enc and v.stats["cache_hits"] == hits + 1   # the embedding cache
    rt.unload()   # the projector goes with the weights (and its cache with it)
    assert v.ctx is None and not v._cache


def test_a_cancel_between_images_stops_before_the_next_encode(rt, tmp_path):
    """Four images of a few hundred tokens each, cancelled once the first is encoded: the worker
    stops between two images (each one step of its loop)."""
    import threading
    import time

    from comfyui_a3b.runtime.errors import Cancelled

    model = write_tiny_gguf(tmp_path / "tiny-qwen2vl.gguf", "qwen2vl", n_ctx=4096)
    shape = dict(SHAPES["tiny-qwen2vl"], n_embd=128, n_layer=4, n_ff=256)
    write_mmproj(tmp_path / "mmproj-mid.gguf", 64, shape)
    spec = rt.spec(str(model), n_gpu_layers=0, n_ctx=4096, n_parallel=1)
    v = rt.load(spec).vision
    big = [image(40 + i, 448, 448) for i in range(4)]
    stream = rt.submit(chat("a", big[0], "b", big[1], "c", big[2], "d", big[3], "?"), model=spec, max_tokens=4)
    deadline = time.monotonic() + 60
    while v.stats["encoded"] < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    threading.Thread(target=stream.cancel).start()
    with pytest.raises(Cancelled):
        stream.result()
    assert 1 <= v.stats["encoded"] < 4, dict(v.stats)


def test_an_image_beyond_the_context_gets_the_too_long_prompt_error(rt, pair):
    _, model = pair
    spec = spec_of(rt, model, n_ctx=24)
    with pytest.raises(PromptTooLong, match="context holds 24"):
        rt.generate(chat("Describe ", image(1)), model=spec, max_tokens=3)


def test_a_projector_of_another_width_is_refused_by_name(rt, tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    wrong = write_mmproj(tmp_path / "other-mmproj.gguf", 48, "tiny-mlp")
    with pytest.raises(ModelLoadFailed, match="projector other-mmproj.gguf.*(mismatch|n_embd)"):
        rt.load(rt.spec(str(model), n_gpu_layers=0, mmproj=str(wrong)))
    with pytest.raises(ModelNotFound, match="was not found"):
        rt.load(rt.spec(str(model), n_gpu_layers=0, mmproj=str(tmp_path / "missing.gguf")))
    # beside the model ("auto"), a projector that does not fit is left out: the model still loads
    (tmp_path / "mmproj-tiny.gguf").write_bytes(wrong.read_bytes())
    m = rt.load(rt.spec(str(model), n_gpu_layers=0, n_ctx=256))
    assert m.vision is None
    # a text model named as a projector is refused with llama.cpp's reason
    with pytest.raises((ModelLoadFailed, CorruptGGUF), match="projector|mmproj|clip"):
        rt.load(rt.spec(str(model), n_gpu_layers=0, n_ctx=128, mmproj=str(model)))


def test_the_planner_counts_the_projector(tmp_path):
    from comfyui_a3b.runtime import LoadSpec
    from comfyui_a3b.runtime.llama.local_engine import ENGINE

    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    proj = write_mmproj(tmp_path / "mmproj-tiny.gguf", 64, "tiny-mlp")
    on, off = LoadSpec(str(model)), LoadSpec(str(model), mmproj="off")
    size = proj.stat().st_size
    assert ENGINE.gpu_bytes(on) - ENGINE.gpu_bytes(off) == size
    assert ENGINE.file_bytes(on) - ENGINE.file_bytes(off) == size
    assert ENGINE.weights_key(on) != ENGINE.weights_key(off)   # a copy with its projector is another copy


def crashing_projector(path) -> None:
    """A projector on which libmtmd's clip loader aborts (GGML_ASSERT n_merge > 0 for minimax_m3)."""
    write_mmproj(path, 64, dict(SHAPES["tiny-mlp"]))
    rewritten_copy(path, path, {"clip.projector_type": "minimax_m3"},
                   lambda w: w.add_uint32("clip.vision.spatial_merge_size", 0))


CHILD = textwrap.dedent("""
    import sys
    from comfyui_a3b.runtime import Runtime
    from comfyui_a3b.runtime.errors import CorruptGGUF
    rt = Runtime()
    try:
        rt.load(rt.spec(sys.argv[1], n_gpu_layers=0, n_ctx=128, mmproj=sys.argv[2]))
    except CorruptGGUF as e:
        print("REFUSED", e)
        sys.exit(0)
    print("LOADED")
""")


def test_a_corrupt_projector_is_refused_after_a_trial_in_a_child(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    bad = tmp_path / "mmproj-bad.gguf"
    crashing_projector(bad)
    env = {**__import__("os").environ, "A3B_CACHE": str(tmp_path / "cache")}
    # loaded in this process without the trial, it takes the process down (that is what vetting is for)
    raw = subprocess.run([sys.executable, "-c", CHILD, str(model), str(bad)], capture_output=True, text=True,
                         timeout=120, env={**env, "A3B_VET": "off", "GGML_NO_BACKTRACE": "1"})
    assert raw.returncode != 0 and "REFUSED" not in raw.stdout and "LOADED" not in raw.stdout
    vetted = subprocess.run([sys.executable, "-c", CHILD, str(model), str(bad)], capture_output=True, text=True,
                            timeout=120, env=env)
    assert vetted.returncode == 0, vetted.stderr[-2000:]
    assert "REFUSED" in vetted.stdout and "crash" in vetted.stdout and "n_merge" in vetted.stdout
