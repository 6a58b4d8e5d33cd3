"""ComfyUI V1 node classes (INPUT_TYPES dicts) built from the declarations in defs.py.

Used by ComfyUI releases without the V3 API, and by the tests: the dicts are the same contract
ComfyUI serves in /object_info for the V3 nodes. Importing this module does not import ComfyUI.
"""
from __future__ import annotations

from typing import Any

from .defs import NODES
from .schema import In, NodeDef


def input_options(i: In) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if i.default is not None:
        opts["default"] = i.default
    for key in ("min", "max", "step", "round", "tooltip"):
        v = getattr(i, key)
        if v is not None:
            opts[key] = v
    if i.multiline:
        opts["multiline"] = True
    if i.force_input:
        opts["forceInput"] = True
    if i.control_after_generate:
        opts["control_after_generate"] = True
    if i.advanced:
        opts["advanced"] = True
    return opts


def input_types(d: NodeDef) -> dict[str, dict]:
    out: dict[str, dict] = {"required": {}}
    for i in d.inputs:
        kind = i.choices() if i.type == "COMBO" else i.type
        out.setdefault("optional" if i.optional else "required", {})[i.name] = (kind, input_options(i))
    out["hidden"] = {"unique_id": "UNIQUE_ID"}
    return out


def make_class(d: NodeDef) -> type:
    def INPUT_TYPES(cls):
        return input_types(d)

    def run(self, unique_id=None, **kwargs):
        node_id = unique_id[0] if isinstance(unique_id, list) else unique_id
        outputs, ui = d.call(node_id, **kwargs)
        return {"ui": ui, "result": outputs} if ui else outputs

    attrs: dict[str, Any] = {
        "INPUT_TYPES": classmethod(INPUT_TYPES),
        "RETURN_TYPES": tuple(o.type for o in d.outputs),
        "RETURN_NAMES": tuple(o.name for o in d.outputs),
        "OUTPUT_IS_LIST": tuple(o.is_list for o in d.outputs),
        "OUTPUT_TOOLTIPS": tuple(o.tooltip for o in d.outputs),
        "FUNCTION": "run",
        "CATEGORY": d.category,
        "DESCRIPTION": d.description,
        "OUTPUT_NODE": d.output_node,
        "INPUT_IS_LIST": d.input_is_list,
        "NOT_IDEMPOTENT": d.not_idempotent,
        "run": run,
        "__doc__": d.description,
    }
    if d.fingerprint is not None:
        attrs["IS_CHANGED"] = classmethod(lambda cls, unique_id=None, **kw: d.fingerprint_of(**kw))
    return type(d.node_id, (), attrs)


NODE_CLASS_MAPPINGS = {d.node_id: make_class(d) for d in NODES}
NODE_DISPLAY_NAME_MAPPINGS = {d.node_id: d.display_name for d in NODES}
