"""The pruned file: written one tensor at a time in the source's types, with its a3b.* metadata.

gguf.py      the GGUF writer (header first, then each tensor's bytes made when written)
align.py     the widths a quantised file can store, and llama-quantize's fallback types
metadata.py  the a3b.* keys every path records, and what a run returns

Above the base modules, beside calibration/; llama.cpp's quantiser is reached through runtime/llama.
"""
