"""Benchmarks: each bench_*.py is one measurement (`python -m comfyui_a3b.bench.NAME`), wired through
the shared harness; every figure is a ratio against a baseline measured in the same run.

common.py        the harness: command lines (the docstring's first paragraph, the model option,
                 --name, --report), output (table, JSON with the machine, PNG under bench/results/),
                 free ports, threads, llama_cpp.server
models.py        random-weight models at real shapes and their token prompts; the tests' tiny models
evaluate.py      perplexity and prompt/decode speed of a file, over the runtime's LlamaEval
llama_server.py  llama.cpp's llama-server, built once from llama-cpp-python's sources
mmproj.py, gemma.py, gpu_memory.py, nextline.py, soak_editor.py: what single benchmarks share
"""
