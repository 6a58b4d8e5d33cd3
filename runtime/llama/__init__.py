"""llama.cpp in this process: the local engine (local_engine.py; see engine.py for the interface) and
everything else that calls llama.cpp, which nothing outside this package does.

local_engine.py  the engine: its models are worker.LoadedModel over a LlamaBackend
cxxruntime.py    llama.cpp's libraries loaded before the C++ runtime where we can (first, below)
binding.py       llama-cpp-python imported once, llama.cpp's log captured, the batch helper
weights.py       one loaded llama_model and its vocabulary; load-error classification
backend.py       contexts for one LoadSpec: decode, sample, embed
vision.py        the multimodal projector (libmtmd): images into the model's embedding space
planner.py       where each tensor goes (pure policy); placement.py and fitting.py apply it to a load;
                 tensorpatterns.py matches the user's placement patterns in linear time (RE2)
threadpool.py    persistent ggml threadpools for a generation context; threadtune.py which one a batch uses
grammar.py       structured output: schemas and grammars compiled by llguidance, matched per token
offload.py       n_gpu_layers="auto" and the main-memory check before a load; devices.py the GPUs
vetchild.py      the vetting server that loads unseen files in a child process (runtime/models/vet.py)
templates.py     chat prompts rendered by llama.cpp's named templates or the GGUF's Jinja template
reencode.py      serving copies re-encoded in a faster format (LoadSpec.serve_as)
evaluate.py      all-position logits of a file (what the pruning tool's tests compare with)
graph.py         observers of llama.cpp's graph evaluation (the pruning tool's statistics)
ggml.py          the ggml functions llama-cpp-python does not bind (tensor struct, sizes)
quantize.py      llama.cpp's quantiser, for rows of values and for whole files

The package's `__init__` loads llama.cpp's libraries and names binding.py's helpers; it imports
no module that imports the rest of the runtime (local_engine.py, weights.py, backend.py: those
reach runtime/models/vet.py and the request path, which import binding.py or templates.py and so run this
`__init__` first). Import those from their modules.
"""
from __future__ import annotations

# before anything below can load the C++ runtime (numpy does): see cxxruntime.py
from . import cxxruntime

cxxruntime.preload()

from .binding import (GGML_TYPES, check_usable, fill_batch, llama, llama_cpp_version, sequence,  # noqa: E402
                      system_info)

__all__ = ["GGML_TYPES", "check_usable", "fill_batch", "llama", "llama_cpp_version", "sequence", "system_info"]
