"""Where a model's multimodal projector is: the `mmproj` load option resolved to a file, or none.

Vision-language models come as a text GGUF and a projector GGUF (`mmproj-*.gguf`) in the same
folder, the usual layout of GGUF repositories. `LoadSpec.mmproj` says which to use: "auto" takes the
projector beside the model, "off" none, anything else is a path. A folder may hold projectors of
several models (ComfyUI's models/LLM): then "auto" takes the one whose name shares the longest start
with the model's name once the `mmproj` prefix and quantisation suffixes are set aside, and only if
one is clearly better than the others; otherwise the model loads without one and the log says
which to name.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

from ..errors import ModelNotFound

log = logging.getLogger("a3b.mmproj")

#: what a projector file is called
PATTERN = "mmproj*.gguf"
_NOISE = re.compile(r"^mmproj[-_.]?|[-_.](f16|f32|bf16|q\d(_[0-9a-z]+)*)$", re.I)


def projectors_in(folder: str | Path) -> list[Path]:
    """The projector files of a folder, sorted by name."""
    try:
        return sorted(p for p in Path(folder).glob(PATTERN) if p.is_file())
    except OSError:
        return []


def _stem(name: str) -> str:
    s = Path(name).stem.lower()
    for _ in range(3):
        s = _NOISE.sub("", s)
    return s


def _shared(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def beside(model_path: str | Path) -> Path | None:
    """The projector "auto" takes for a model file (module docstring), or None. The store asks at
    every request (it keys the weights by their files): the answer is kept until the folder changes."""
    model = Path(model_path)
    try:
        stamp = model.parent.stat().st_mtime_ns
    except OSError:
        return None
    key = (str(model), stamp)
    if key not in _beside:
        if len(_beside) > 256:
            _beside.clear()
        _beside[key] = _find_beside(model)
    return _beside[key]


_beside: dict[tuple[str, int], Path | None] = {}


def _find_beside(model: Path) -> Path | None:
    found = [p for p in projectors_in(model.parent) if p.resolve() != model.resolve()]
    if len(found) <= 1:
        return found[0] if found else None
    want = _stem(model.name)
    scored = sorted(((_shared(want, _stem(p.name)), p) for p in found), key=lambda t: -t[0])
    if scored[0][0] >= 4 and scored[0][0] > scored[1][0]:
        return scored[0][1]
    log.warning("%s: several projectors beside it (%s) and none clearly its own; loading it without one. Name "
                "the projector (mmproj) to see images.", model.name, ", ".join(p.name for p in found))
    return None


def resolve(model_path: str | Path, mmproj: str | None) -> Path | None:
    """The projector file a load uses (None: none)."""
    if mmproj in (None, "", "off"):
        return None
    if mmproj == "auto":
        return beside(model_path)
    p = Path(mmproj).expanduser()
    if not p.is_absolute() and not p.exists():
        p = Path(model_path).parent / p
    if not p.is_file():
        raise ModelNotFound(f"The projector {mmproj!r} was not found (looked at {p}). Give the path of the "
                            "mmproj GGUF that belongs to the model, or 'auto' to take the one beside it.")
    return p


__all__ = ["PATTERN", "beside", "projectors_in", "resolve"]
