"""ComfyUI nodes: thin adapters over the runtime.

core.py (the loader's part: which model, loaded how) and generation.py (A3BGenerate's) hold what
the nodes do, with no ComfyUI import; schema.py says how a node is declared and defs.py declares
each node once; v3.py and v1.py present them to ComfyUI, comfy.py wraps the ComfyUI services they use.
"""
