"""What the node tests share: running a node as ComfyUI does (through the V1 mappings)."""
from __future__ import annotations

from comfyui_a3b.nodes import core, defs
from comfyui_a3b.nodes.v1 import NODE_CLASS_MAPPINGS

GEN = dict(system="", max_new_tokens=24, temperature=0.4, top_p=0.95, top_k=40, min_p=0.05,
           repeat_penalty=1.1, seed=7, stop="", confidence_aware=False)


def node(name):
    return NODE_CLASS_MAPPINGS[name]()


def loader_args(model=core.DEFAULT_CHOICE, **kw):
    return {**defs.LOADER.defaults(), "model": model, **kw}


def generate(handle, prompt, **kw):
    args = {**GEN, **kw}
    return node("A3BGenerate").run(unique_id="2", model=handle, prompt=prompt, **args)
