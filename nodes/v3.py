"""ComfyUI V3 nodes (`io.ComfyNode`, `comfy_entrypoint`) built from the declarations in defs.py.

Imports ComfyUI's `comfy_api.latest`, so import this module only inside ComfyUI.
"""
from __future__ import annotations

from typing import Any

from comfy_api.latest import ComfyExtension, io

from .defs import NODES
from .schema import In, NodeDef, Out


def _input(i: In):
    inp = _make_input(i)
    if i.advanced:   # ComfyUI releases without the flag pass it on in /object_info all the same
        inp.extra_dict = {**(getattr(inp, "extra_dict", None) or {}), "advanced": True}
    return inp


def _make_input(i: In):
    common: dict[str, Any] = {"optional": i.optional, "tooltip": i.tooltip}
    if i.type == "INT":
        return io.Int.Input(i.name, default=i.default, min=i.min, max=i.max, step=i.step,
                            control_after_generate=i.control_after_generate or None, **common)
    if i.type == "FLOAT":
        return io.Float.Input(i.name, default=i.default, min=i.min, max=i.max, step=i.step, round=i.round,
                              **common)
    if i.type == "STRING":
        return io.String.Input(i.name, default=i.default, multiline=i.multiline,
                               force_input=i.force_input or None, **common)
    if i.type == "BOOLEAN":
        return io.Boolean.Input(i.name, default=i.default, **common)
    if i.type == "COMBO":
        return io.Combo.Input(i.name, options=i.choices(), default=i.default, **common)
    return io.Custom(i.type).Input(i.name, **common)


def _output(o: Out, taken: set[str]):
    # V3 ids must differ from input ids; the name users see (display_name) stays the same.
    oid = f"{o.name}_out" if o.name in taken else o.name
    if o.type == "STRING":
        return io.String.Output(oid, display_name=o.name, tooltip=o.tooltip, is_output_list=o.is_list)
    return io.Custom(o.type).Output(oid, display_name=o.name, tooltip=o.tooltip, is_output_list=o.is_list)


def make_node(d: NodeDef) -> type[io.ComfyNode]:
    class Node(io.ComfyNode):
        @classmethod
        def define_schema(cls) -> io.Schema:
            return io.Schema(node_id=d.node_id, display_name=d.display_name, category=d.category,
                             description=d.description, inputs=[_input(i) for i in d.inputs],
                             outputs=[_output(o, {i.name for i in d.inputs}) for o in d.outputs],
                             hidden=[io.Hidden.unique_id],
                             is_output_node=d.output_node, is_input_list=d.input_is_list,
                             not_idempotent=d.not_idempotent)

        @classmethod
        def execute(cls, **kwargs) -> io.NodeOutput:
            node_id = cls.hidden.unique_id if cls.hidden is not None else None
            outputs, ui = d.call(node_id, **kwargs)
            return io.NodeOutput(*outputs, ui=ui)

    if d.fingerprint is not None:
        Node.fingerprint_inputs = classmethod(lambda cls, **kw: d.fingerprint_of(**kw))
    Node.__name__ = Node.__qualname__ = d.node_id
    return Node


NODE_LIST = [make_node(d) for d in NODES]


class A3BExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODE_LIST


async def comfy_entrypoint() -> A3BExtension:
    return A3BExtension()
