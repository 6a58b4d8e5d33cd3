"""ComfyUI nodes: thin adapters over the runtime.

core.py holds what the nodes do (no ComfyUI import), defs.py declares the nodes once, v3.py and
v1.py present them to ComfyUI, comfy.py wraps the ComfyUI services they use.
"""
