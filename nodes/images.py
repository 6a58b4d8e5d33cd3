"""ComfyUI's IMAGE (a float tensor, batch x height x width x channels, values 0..1) as the runtime's
image parts, one per image of the batch, and the projector dropdown of A3BLoader.

Checked before anything reaches the model, each with a message: the tensor's rank and channels,
an empty batch or image, NaN or infinity. Values slightly outside 0..1 (some nodes overshoot) are
clipped; one channel is gray, a fourth channel is alpha laid over white, as images.py does for files.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime.errors import InvalidImage
from ..runtime.models.locate import list_models
from ..runtime.models.mmproj import PATTERN
from ..runtime.requests import ImagePart

#: A3BGenerate's image_mode choices
ALL_IN_ONE = "all in one prompt"
ONE_EACH = "one request per image"
IMAGE_MODES = (ALL_IN_ONE, ONE_EACH)
#: A3BLoader's mmproj choices besides the files found
MMPROJ_WORDS = ("auto", "off")


def _array(image: Any) -> np.ndarray:
    if hasattr(image, "detach"):   # a torch.Tensor, without importing torch
        image = image.detach().to("cpu").float().numpy()
    try:
        return np.asarray(image)
    except Exception as e:  # noqa: BLE001 - anything that is not an array
        raise InvalidImage(f"The image input is not an image tensor ({type(image).__name__}: {e}).") from None


def tensor_images(image: Any) -> list[ImagePart]:
    """Each image of a ComfyUI IMAGE batch as 8-bit RGB pixels."""
    a = _array(image)
    if a.ndim == 3:
        a = a[None]
    if a.ndim != 4:
        raise InvalidImage(f"The image input has shape {tuple(a.shape)}; ComfyUI's IMAGE is batch x height x width "
                           "x channels (rank 4). Connect an IMAGE output (Load Image, VAE Decode).")
    b, h, w, c = a.shape
    if b == 0 or h == 0 or w == 0:
        raise InvalidImage(f"The image input is empty (shape {tuple(a.shape)}).")
    if c not in (1, 3, 4):
        raise InvalidImage(f"The image input has {c} channels; 3 (RGB), 1 (gray) or 4 (with alpha) are taken. "
                           "Is it a latent or a mask? Decode it to an IMAGE first.")
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise InvalidImage(f"The image input holds {a.dtype} values, not numbers.")
    a = a.astype(np.float32, copy=False)
    bad = ~np.isfinite(a)
    if bad.any():
        i = int(np.argwhere(bad.reshape(b, -1).any(axis=1))[0, 0])
        raise InvalidImage(f"Image #{i + 1} of the batch holds NaN or infinite values ({int(bad.sum())} of them); "
                           "the node before it produced broken pixels.")
    a = np.clip(a, 0.0, 1.0)
    if c == 1:
        a = np.repeat(a, 3, axis=3)
    elif c == 4:
        a = a[..., :3] * a[..., 3:] + (1.0 - a[..., 3:])
    px = np.round(a * 255.0).astype(np.uint8)
    return [ImagePart(rgb=px[i].tobytes(), width=w, height=h) for i in range(b)]


def mmproj_choices() -> list[str]:
    """auto, off, then the projector files in the model folders."""
    return [*MMPROJ_WORDS, *(m for m in list_models() if is_projector(m))]


def is_projector(name: str) -> bool:
    """Whether a model folder's file name is a projector's (left out of the model dropdown)."""
    from fnmatch import fnmatch

    return fnmatch(name.rsplit("/", 1)[-1].lower(), PATTERN)


def resolve_mmproj(choice: str | None) -> str:
    """The loader's mmproj choice as LoadSpec.mmproj: a word as it is, a file name resolved inside the
    model folders (names arrive over ComfyUI's HTTP API: nothing outside them is opened)."""
    from ..runtime.models.locate import resolve_model

    if choice in (None, "", *MMPROJ_WORDS):
        return choice or "auto"
    return str(resolve_model(choice, restrict=True))


__all__ = ["ALL_IN_ONE", "IMAGE_MODES", "MMPROJ_WORDS", "ONE_EACH", "is_projector", "mmproj_choices",
           "resolve_mmproj", "tensor_images"]
