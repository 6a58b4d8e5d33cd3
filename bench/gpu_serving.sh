#!/bin/sh
# a3b serve against llama-server, and the runtime against llama-batched-bench, on one GPU, in one run:
# a random-weight Qwen3-8B-shaped Q4_0 file, all layers on the GPU (bench_serving.py, bench_chains.py,
# bench_gpu.py).
#
#   PYTHONPATH=<folder holding comfyui_a3b>:<site folder> sh bench/gpu_serving.sh OUT BIN [MODEL]
#
# BIN: llama-server and llama-batched-bench built from the vendored llama.cpp of the installed
# llama-cpp-python (docs/gpu.md); the CUDA build of llama-cpp-python on PYTHONPATH, or its Python
# package with LLAMA_CPP_LIB_PATH and MTMD_CPP_LIB set to BIN (one build for both). About 2-6
# minutes on one H200 (four requests per client and cell: a cell of two lasted under a second
# at one client, and the machine moves 10-25% run to run).
# Results: OUT/serving_gpu.{json,png}, OUT/chains_gpu.json, OUT/bench_gpu.{json,png}, OUT/*.log.
set -eu
if [ $# -lt 2 ]; then
    echo "usage: sh bench/gpu_serving.sh OUT BIN [MODEL]" >&2
    exit 2
fi
OUT=$1
BIN=$2
MODEL=${3:-$OUT/random-qwen3-8b.q4_0.gguf}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ ! -f "$MODEL" ]; then
    "$PY" -c "import sys; from pathlib import Path; from comfyui_a3b.bench.models import SHAPES, write_model; \
write_model(Path(sys.argv[1]), SHAPES['qwen3-8b'])" "$MODEL"
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
"$PY" -m comfyui_a3b.bench.bench_serving --gpu --model "$MODEL" --token-prompts --llama-server "$BIN/llama-server" \
    --clients 1,4,16 --parallel 16 --n-ctx 512 --rounds 4 --name serving_gpu --out "$OUT" 2>&1 | tee "$OUT/serving_gpu.log"
"$PY" -m comfyui_a3b.bench.bench_chains --gpu --model "$MODEL" --token-prompts --parallel 16 --name chains_gpu \
    2>&1 | tee "$OUT/chains_gpu.log"
cp "$(dirname "$0")/results/chains_gpu.json" "$OUT/" 2>/dev/null || true
"$PY" -m comfyui_a3b.bench.bench_gpu --out "$OUT" --model "$MODEL" --bin "$BIN" --only runtime,tools \
    2>&1 | tee "$OUT/bench_gpu.log"
