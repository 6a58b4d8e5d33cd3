"""Which tensors of a mixture-of-experts GGUF carry its experts, and whether they can be pruned here.

The router (`ffn_gate_inp`) has one row per routed expert; the expert tensors (`*_exps`) stack one
matrix per expert along their first numpy axis, gate and up either apart or fused; a shared expert
(`*_shexp`, qwen35moe) is a dense FFN every token sees. Everything else must be absent: a tensor
expert pruning does not know how to slice is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...runtime.errors import UnsupportedArchitecture
from ..errors import InvalidRequest
from ..layout import MOE_ARCHITECTURES, is_moe, layer_of
from ..source import SourceModel

ROUTER = "ffn_gate_inp.weight"
#: Per-layer tensors whose first (numpy) axis runs over the routed experts.
GATE_UP_EXPS = ("ffn_gate_exps.weight", "ffn_up_exps.weight")
FUSED_EXPS = "ffn_gate_up_exps.weight"   # gate rows then up rows of each expert, in one tensor
DOWN_EXPS = "ffn_down_exps.weight"
EXPERT_TENSORS = (*GATE_UP_EXPS, FUSED_EXPS, DOWN_EXPS)
SHARED_ROWS = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight")
SHARED_DOWN = "ffn_down_shexp.weight"
SHARED_GATE = "ffn_gate_inp_shexp.weight"   # the shared expert's sigmoid gate: one value per token
KNOWN = {ROUTER, *EXPERT_TENSORS, *SHARED_ROWS, SHARED_DOWN, SHARED_GATE}



@dataclass(frozen=True)
class MoELayout:
    arch: str
    n_layer: int
    n_embd: int
    n_expert: int
    n_expert_used: int | list[int]       # one value, or one per layer
    n_ff_exp: int
    n_ff_shexp: int | None               # the shared expert's width; None without one
    fused: bool                          # gate and up stored together (ffn_gate_up_exps)

    @property
    def used_max(self) -> int:
        u = self.n_expert_used
        return max(u) if isinstance(u, list) else int(u)


def _widths(v, what: str, file_name: str, arch: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, list):
        ws = sorted({int(x) for x in v})
        if len(ws) != 1:
            raise UnsupportedArchitecture(
                f"{file_name} has {what} that differ per layer ({', '.join(map(str, ws[:6]))}); llama.cpp builds "
                f"{arch} experts from one width, so this file cannot be pruned to a uniform expert width here.")
        return ws[0]
    return int(v)


def check_moe_layout(src: SourceModel) -> MoELayout:
    """The expert layout of `src`, or UnsupportedArchitecture / InvalidRequest saying what is wrong."""
    arch, name = src.info.architecture, src.path.name
    names = list(src.tensors)
    if not is_moe(names):
        raise InvalidRequest(
            f"{name} is a dense model ({arch}): it has no routed experts, so --experts-keep has nothing to remove. "
            "Use --keep to remove FFN neurons instead.")
    if arch not in MOE_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"{name} is a mixture-of-experts model of architecture {arch!r}; expert pruning is checked for "
            f"{', '.join(MOE_ARCHITECTURES)} (which tensors carry the experts, how the router weights them). "
            "Pick a model of one of those.")
    if not src.meta(f"{arch}.expert_count"):
        raise UnsupportedArchitecture(f"{name} has expert tensors but no {arch}.expert_count: nothing says how many "
                                      "experts each layer has.")
    n_layer = src.hp.n_layer
    n_expert = int(src.meta(f"{arch}.expert_count"))
    used = src.meta(f"{arch}.expert_used_count")
    if used is None:
        raise UnsupportedArchitecture(f"{name} has no {arch}.expert_used_count: nothing says how many experts "
                                      "each token is routed to.")
    used = [int(x) for x in used] if isinstance(used, list) else int(used)
    if int(src.meta(f"{arch}.expert_group_count", 0) or 0) > 1:
        raise UnsupportedArchitecture(f"{name} routes experts in groups ({arch}.expert_group_count); removing "
                                      "experts would break the groups, which is not supported.")
    if int(src.meta(f"{arch}.nextn_predict_layers", 0) or 0) > 0:
        raise UnsupportedArchitecture(
            f"{name} has multi-token-prediction layers ({arch}.nextn_predict_layers) whose experts calibration does "
            "not reach; convert the model without them to prune its experts.")
    shapes = {n: src.shape(n) for n in names}
    ffe = _widths(src.meta(f"{arch}.expert_feed_forward_length"), "expert FFN widths", name, arch)
    if ffe is None:
        ffe = shapes.get(f"blk.0.{DOWN_EXPS}", (0, 0, 0))[-1]
    ffs = _widths(src.meta(f"{arch}.expert_shared_feed_forward_length"), "shared expert FFN widths", name, arch)
    fused = f"blk.0.{FUSED_EXPS}" in shapes
    n_embd = src.hp.n_embd
    shared = any(n.endswith(SHARED_DOWN) for n in names)
    if not shared:
        ffs = None  # a width key without shared-expert tensors: nothing to narrow
    elif ffs is None:
        ffs = shapes[f"blk.0.{SHARED_DOWN}"][-1]
    for n in names:
        il = layer_of(n)
        if il is None:
            continue
        part = n.split(".", 2)[2]
        if part.startswith("ffn_") and "norm" not in part and part not in KNOWN or "exp_probs" in part:
            raise UnsupportedArchitecture(f"{name} has {n}, an FFN tensor expert pruning does not know how to "
                                          "slice; it handles the router, the routed and the shared experts.")
    for i in range(n_layer):
        p = f"blk.{i}."
        want = {ROUTER: (n_expert, n_embd), DOWN_EXPS: (n_expert, n_embd, ffe)}
        if fused:
            want[FUSED_EXPS] = (n_expert, 2 * ffe, n_embd)
        else:
            want.update({t: (n_expert, ffe, n_embd) for t in GATE_UP_EXPS})
        if shared:
            want.update({t: (ffs, n_embd) for t in SHARED_ROWS})
            want[SHARED_DOWN] = (n_embd, ffs)
        for part, shape in want.items():
            got = shapes.get(p + part)
            if got is None:
                raise UnsupportedArchitecture(f"{name} has no {p}{part}: every layer needs its router and experts.")
            if got != shape:
                what = ("experts of differing widths" if part in EXPERT_TENSORS and len(got) == 3
                        and got[0] == n_expert else "a shape the metadata does not describe")
                raise UnsupportedArchitecture(f"{name}: {p}{part} has shape {got}, expected {shape} ({what}); "
                                              "expert pruning needs one expert count and one expert width.")
    return MoELayout(arch, n_layer, n_embd, n_expert, used, ffe, ffs, fused)
