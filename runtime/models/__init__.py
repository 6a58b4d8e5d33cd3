"""Model management, whatever engine runs the model: where model files are found (locate.py), what
a GGUF holds (gguf_info.py, over ggufscan.py's bounded header read) and whether this build of
llama.cpp loads it (vet.py, in a child process), projectors beside a model (mmproj.py), LoRA
adapters and their keys (adapters.py), the store of loaded models (store.py), giving device memory
back (handover.py) and host memory back to the OS (memory.py)."""
