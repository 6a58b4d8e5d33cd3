"""Which GGUFs can be FFN-pruned, and what exactly is missing for the others (no torch).

Pruning removes FFN neurons: rows of ffn_gate / ffn_up (and their biases), columns of ffn_down.
That is only right where llama.cpp builds each layer's FFN as down(act(gate x) * up x) (or
down(act(up x))) from one width for every layer, read from `<arch>.feed_forward_length`, and where
no other tensor depends on that width. The architectures below were checked against llama.cpp's
model code (tensor shapes and graph) and tested with tiny files of each; others are refused with a
message that names the architecture and the reason, rather than risk a file that loads and is wrong
(phi3, for one, stores gate and up fused in one ffn_up of twice the width).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..runtime.errors import UnsupportedArchitecture

#: Checked for streamed FFN-neuron pruning with llama.cpp calibration.
STREAMED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen35", "gemma3")
#: Architectures with a torch reference forward (recovery, the sequential a3b method, head pruning).
TORCH_ARCHITECTURES = ("llama", "qwen2", "qwen3")
#: llama.cpp reads ffn_down.bias for these (others refuse a file that has it).
DOWN_BIAS_ARCHITECTURES = ("llama",)
#: Mixture-of-experts architectures whose experts can be removed or narrowed (experts/): checked
#: against llama.cpp's model code and tested with tiny files of each.
MOE_ARCHITECTURES = ("qwen3moe", "qwen35moe")

#: Per-block tensors that carry the FFN width, and along which axis (numpy layout: 0 = rows).
ROW_SLICED = ("ffn_gate.weight", "ffn_up.weight", "ffn_gate.bias", "ffn_up.bias")
COL_SLICED = ("ffn_down.weight",)
MOE_MARKERS = ("ffn_gate_inp", "_exps", "_shexp")
#: The norm llama.cpp applies to the FFN output before the residual add, where the model has one.
POST_FFN_NORM = "post_ffw_norm.weight"


@dataclass(frozen=True)
class FFNLayout:
    arch: str
    n_layer: int
    n_ff: int
    gated: bool
    down_bias_ok: bool
    #: an RMSNorm on the FFN output before the residual add (Gemma's `post_ffw_norm`): the error that
    #: matters is then relative to each token's FFN output size, so calibration weights tokens by it
    post_norm: bool = False


def layer_of(name: str) -> int | None:
    """The block number of a `blk.N.*` tensor name (None for other names)."""
    if not name.startswith("blk."):
        return None
    try:
        return int(name.split(".")[1])
    except (IndexError, ValueError):
        return None


def is_moe(tensor_names) -> bool:
    """Whether a file's layers carry routed or shared experts (a router, *_exps or *_shexp tensors)."""
    return any(layer_of(n) is not None and any(m in n for m in MOE_MARKERS) for n in tensor_names)


def check_layout(arch: str, tensor_names: list[str], tensor_shapes: dict[str, tuple[int, ...]], n_layer: int,
                 feed_forward_length, file_name: str) -> FFNLayout:
    """The FFN layout of a GGUF, or UnsupportedArchitecture saying what is missing.

    `tensor_shapes` are numpy shapes (rows first); `feed_forward_length` is the metadata value
    (an int, or a list of one value per layer).
    """
    moe = sorted({n.split(".", 2)[2] for n in tensor_names
                  if layer_of(n) is not None and any(m in n for m in MOE_MARKERS)})  # is_moe, named
    if moe:
        raise UnsupportedArchitecture(
            f"{file_name} ({arch}) has a mixture-of-experts FFN ({', '.join(moe[:4])}): FFN-neuron pruning "
            "handles dense gate/up/down FFNs, and expert pruning (--experts-keep) is checked for "
            f"{', '.join(MOE_ARCHITECTURES)}.")
    if arch not in STREAMED_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"FFN pruning is checked for the {', '.join(STREAMED_ARCHITECTURES)} architectures; {file_name} is "
            f"{arch!r}, whose FFN layout (which tensors carry the FFN width, and whether llama.cpp builds every "
            "layer from one width) has not been checked. Pick a model of a supported architecture.")
    if feed_forward_length is None:
        raise UnsupportedArchitecture(f"{file_name} has no {arch}.feed_forward_length: nothing says the FFN width.")
    if isinstance(feed_forward_length, list):
        widths = sorted({int(x) for x in feed_forward_length})
        if len(widths) != 1:
            raise UnsupportedArchitecture(
                f"{file_name} has FFN widths that differ per layer ({', '.join(map(str, widths[:6]))}"
                f"{', ...' if len(widths) > 6 else ''}); llama.cpp builds {arch} layers from one width, so such a "
                "file cannot be pruned to a uniform width here. Prune the original model instead.")
        n_ff = widths[0]
    else:
        n_ff = int(feed_forward_length)
    gated = None
    for i in range(n_layer):
        p = f"blk.{i}."
        for part in ("ffn_up.weight", "ffn_down.weight"):
            if p + part not in tensor_shapes:
                raise UnsupportedArchitecture(f"{file_name} has no {p}{part}: FFN pruning needs an up and a down "
                                              "projection in every layer.")
        g = p + "ffn_gate.weight" in tensor_shapes
        if gated is None:
            gated = g
        elif g != gated:
            raise UnsupportedArchitecture(f"{file_name}: some layers have ffn_gate and others not.")
        for part in ROW_SLICED:
            s = tensor_shapes.get(p + part)
            if s is not None and s[0] != n_ff:
                raise UnsupportedArchitecture(f"{file_name}: {p}{part} has {s[0]} rows, not the FFN width {n_ff}.")
        s = tensor_shapes[p + "ffn_down.weight"]
        if s[-1] != n_ff:
            raise UnsupportedArchitecture(f"{file_name}: {p}ffn_down.weight has {s[-1]} columns, not the FFN "
                                          f"width {n_ff}.")
    known = set(ROW_SLICED) | set(COL_SLICED)
    for name in tensor_names:
        if layer_of(name) is None:
            continue
        part = name.split(".", 2)[2]
        if part.startswith("ffn_") and part not in known and "norm" not in part and "ffn_down.bias" != part:
            raise UnsupportedArchitecture(f"{file_name} has {name}, an FFN tensor pruning does not know how to "
                                          "narrow; FFN pruning handles ffn_gate / ffn_up / ffn_down and their biases.")
    post_norm = all(f"blk.{i}.{POST_FFN_NORM}" in tensor_shapes for i in range(n_layer)) and n_layer > 0
    return FFNLayout(arch, n_layer, n_ff, bool(gated), arch in DOWN_BIAS_ARCHITECTURES, post_norm)
