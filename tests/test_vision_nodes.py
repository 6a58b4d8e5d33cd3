"""A3BGenerate's image input and A3BLoader's projector dropdown, without ComfyUI: ComfyUI's IMAGE
tensors (numpy here, the same layout) to image parts, every bad tensor refused, a batch in one
prompt or one request per image."""
from __future__ import annotations

import numpy as np
import pytest

from comfyui_a3b.nodes import core, defs
from comfyui_a3b.nodes.images import ALL_IN_ONE, ONE_EACH, mmproj_choices, tensor_images
from comfyui_a3b.nodes.v1 import NODE_CLASS_MAPPINGS, input_types
from comfyui_a3b.runtime import add_model_dir
from comfyui_a3b.runtime.errors import InvalidImage, VisionUnavailable

GEN = dict(system="", max_new_tokens=10, temperature=0.0, top_p=0.95, top_k=40, min_p=0.05,
           repeat_penalty=1.0, seed=7, stop="", confidence_aware=False)


def batch(n: int = 2, h: int = 6, w: int = 8, c: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, h, w, c), dtype=np.float32)


def test_a_comfyui_batch_becomes_one_rgb_image_each():
    parts = tensor_images(batch(3))
    assert len(parts) == 3 and all(p.width == 8 and p.height == 6 and len(p.rgb) == 8 * 6 * 3 for p in parts)
    one = tensor_images(batch(1)[0])   # a single image without its batch axis
    assert len(one) == 1 and one[0].rgb == tensor_images(batch(1))[0].rgb
    x = np.zeros((1, 1, 2, 3), np.float32)
    x[0, 0, 1] = [1.0, 0.5, 1.7]   # overshoot is clipped
    assert tensor_images(x)[0].rgb == bytes([0, 0, 0, 255, 128, 255])
    gray = tensor_images(np.full((1, 1, 1, 1), 0.5, np.float32))[0].rgb
    assert gray == bytes([128] * 3)
    rgba = np.array([[[[1.0, 0.0, 0.0, 0.0]]]], np.float32)   # transparent: white
    assert tensor_images(rgba)[0].rgb == bytes([255, 255, 255])


@pytest.mark.parametrize("value, message", [
    (np.zeros((2, 3), np.float32), "rank 4"),
    (np.zeros((1, 2, 2, 2, 3), np.float32), "rank 4"),
    (np.zeros((0, 4, 4, 3), np.float32), "empty"),
    (np.zeros((1, 0, 4, 3), np.float32), "empty"),
    (np.zeros((1, 4, 4, 16), np.float32), "16 channels"),
    (np.array([[[["a", "b", "c"]]]]), "not numbers"),
    ("an image", "rank 4"),
])
def test_bad_tensors_are_refused(value, message):
    with pytest.raises(InvalidImage, match=message):
        tensor_images(value)


def test_nan_names_the_image():
    x = batch(3)
    x[1, 2, 3, 0] = np.nan
    with pytest.raises(InvalidImage, match="Image #2 of the batch holds NaN"):
        tensor_images(x)
    x[1, 2, 3, 0] = np.inf
    with pytest.raises(InvalidImage, match="NaN or infinite"):
        tensor_images(x)


def test_generate_schema_has_the_image_inputs():
    opt = input_types(defs.GENERATE)["optional"]
    assert opt["image"][0] == "IMAGE"
    assert opt["image_mode"][0] == [ALL_IN_ONE, ONE_EACH] and opt["image_mode"][1]["default"] == ALL_IN_ONE
    assert input_types(defs.LOADER)["optional"]["mmproj"][0][:2] == ["auto", "off"]


def test_projectors_are_listed_for_the_loader_not_as_models(tmp_path, default_path):
    d = tmp_path / "LLM"
    d.mkdir()
    (d / "mmproj-model-f16.gguf").write_bytes(b"GGUF")
    (d / "model.gguf").write_bytes(b"GGUF")
    add_model_dir(d)
    assert "mmproj-model-f16.gguf" in mmproj_choices()
    assert "mmproj-model-f16.gguf" not in core.model_choices() and "model.gguf" in core.model_choices()


def run(handle, image, **kw):
    return NODE_CLASS_MAPPINGS["A3BGenerate"]().run(unique_id="9", model=handle, prompt="Describe it.", image=image,
                                                     **{**GEN, **kw})["result"]


def test_generate_with_images_all_in_one_or_one_each(fake_engine):
    handle = core.load_model("fake://nodeeye?vision=1")
    imgs = batch(2)
    both = run(handle, imgs)
    first = run(handle, imgs[:1])
    second = run(handle, imgs[1:])
    again = run(handle, imgs[:1])
    each = run(handle, imgs, image_mode=ONE_EACH)
    plain = run(handle, None)
    assert first[0] == again[0] and len({both[0], first[0], second[0], plain[0]}) == 4
    assert each[0] == first[0] + "\n\n" + second[0]
    assert each[1].startswith("[[") or each[1] == "[[], []]"
    with pytest.raises(VisionUnavailable, match="mmproj"):
        run(core.load_model("fake://nodeblind"), imgs)
