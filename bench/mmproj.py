"""Random-weight multimodal projectors (mmproj GGUF) with the metadata and tensor names llama.cpp's
clip loader expects: `mlp` (LLaVA's CLIP vision tower and two-layer MLP projector) and
`qwen2vl_merger` (Qwen2-VL's vision tower with its 2x2 patch merger, M-RoPE).

The benchmarks write them at real shapes; the tests at tiny ones (tests/test_vision*.py). The text
model a projector pairs with must have `n_embd_text` as its embedding width; Qwen2-VL's projector
pairs with a `qwen2vl` text model (M-RoPE positions).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

SHAPES = {
    # LLaVA-1.5's vision tower, CLIP ViT-L/14 at 336 px (576 image tokens):
    # https://huggingface.co/openai/clip-vit-large-patch14-336/blob/main/config.json
    "clip-l-336": dict(kind="mlp", n_embd=1024, n_layer=24, n_head=16, n_ff=4096, image_size=336, patch_size=14),
    # Qwen2-VL's vision tower (2B and 7B share it): depth 32, width 1280, 16 heads, MLP ratio 4, patch 14
    # https://huggingface.co/Qwen/Qwen2-VL-7B-Instruct/blob/main/config.json
    "qwen2-vl": dict(kind="qwen2vl_merger", n_embd=1280, n_layer=32, n_head=16, n_ff=5120, image_size=560,
                     patch_size=14),
    "tiny-mlp": dict(kind="mlp", n_embd=32, n_layer=2, n_head=2, n_ff=64, image_size=56, patch_size=14),
    "tiny-qwen2vl": dict(kind="qwen2vl_merger", n_embd=32, n_layer=2, n_head=2, n_ff=64, image_size=112,
                         patch_size=14),
}
#: OpenAI CLIP's normalisation (LLaVA) and Qwen2-VL's (the same values)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def write_mmproj(path: str | Path, n_embd_text: int, shape: str | dict = "tiny-mlp", *, seed: int = 0,
                 dtype=np.float32, scale: float = 0.05) -> Path:
    """A random projector of `shape` (a name of SHAPES or such a dict) into a text model `n_embd_text` wide.
    Matrices are `dtype` (f16 at real shapes), norms and biases f32."""
    import gguf

    s = SHAPES[shape] if isinstance(shape, str) else shape
    kind, e, ff, p = s["kind"], s["n_embd"], s["n_ff"], s["patch_size"]
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name(f"random-{kind}")
    w.add_string("clip.projector_type", kind)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_audio_encoder", False)
    w.add_uint32("clip.vision.embedding_length", e)
    w.add_uint32("clip.vision.feed_forward_length", ff)
    w.add_uint32("clip.vision.block_count", s["n_layer"])
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_uint32("clip.vision.attention.head_count", s["n_head"])
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.image_size", s["image_size"])
    w.add_uint32("clip.vision.patch_size", p)
    w.add_array("clip.vision.image_mean", CLIP_MEAN)
    w.add_array("clip.vision.image_std", CLIP_STD)
    w.add_bool("clip.use_gelu", kind == "mlp")
    w.add_uint32("general.file_type", 1 if dtype == np.float16 else 0)

    def mat(name: str, *shape_: int):
        w.add_tensor(name, (rng.standard_normal(shape_, dtype=np.float32) * scale).astype(dtype))

    def vec(name: str, n: int, value: float | None = None):
        v = np.full(n, value, np.float32) if value is not None else rng.standard_normal(n, dtype=np.float32) * scale
        w.add_tensor(name, v.astype(np.float32))

    n_patches = (s["image_size"] // p) ** 2
    # convolution kernels are f16 as the converters write them (ggml's im2col takes f16 kernels)
    w.add_tensor("v.patch_embd.weight", (rng.standard_normal((e, 3, p, p), dtype=np.float32) * scale)
                 .astype(np.float16))
    if kind == "mlp":
        vec("v.patch_embd.bias", e)
        mat("v.position_embd.weight", n_patches, e)
        vec("v.pre_ln.weight", e, 1.0)
        vec("v.pre_ln.bias", e, 0.0)
    else:   # Qwen2-VL: a second kernel for the temporal pair of frames, no learned positions
        w.add_tensor("v.patch_embd.weight.1", (rng.standard_normal((e, 3, p, p), dtype=np.float32) * scale)
                     .astype(np.float16))
    for i in range(s["n_layer"]):
        b = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            mat(b + name + ".weight", e, e)
            vec(b + name + ".bias", e)
        for name in ("ln1", "ln2"):
            vec(b + name + ".weight", e, 1.0)
            vec(b + name + ".bias", e, 0.0)
        mat(b + "ffn_up.weight", ff, e)
        vec(b + "ffn_up.bias", ff)
        mat(b + "ffn_down.weight", e, ff)
        vec(b + "ffn_down.bias", e)
    if kind == "mlp":
        hidden = n_embd_text
        mat("mm.0.weight", hidden, e)
        vec("mm.0.bias", hidden)
        mat("mm.2.weight", n_embd_text, hidden)
        vec("mm.2.bias", n_embd_text)
    else:   # the merger: layer norm, then an MLP over 2x2 neighbouring patches
        vec("v.post_ln.weight", e, 1.0)
        vec("v.post_ln.bias", e, 0.0)
        mat("mm.0.weight", 4 * e, 4 * e)
        vec("mm.0.bias", 4 * e)
        mat("mm.2.weight", n_embd_text, 4 * e)
        vec("mm.2.bias", n_embd_text)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


__all__ = ["SHAPES", "write_mmproj"]
