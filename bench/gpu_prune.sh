#!/bin/sh
# Streamed pruning of a random-weight Qwen3-8B-shape GGUF with llama.cpp calibration on the GPU, and
# the CUDA decode/prefill speed of the pruned files against the unpruned one (bench_gpu_prune.py).
#
#   PYTHONPATH=<folder holding comfyui_a3b>:<site folder> sh bench/gpu_prune.sh OUT [extra options]
#   sh bench/gpu_prune.sh OUT --shape tiny          # a quick check on a CPU-only machine
#
# Needs: a CUDA build of llama-cpp-python (docs/gpu.md) with its dependencies, gguf, tqdm and pyyaml;
# not torch. About 5-8 minutes on one H200 (the model is written there first: 4.6 GB, plus two pruned
# copies). Results: OUT/bench_gpu_prune.json, .md, .log and .png (the PNG only where matplotlib is
# installed; otherwise `python -m comfyui_a3b.bench.bench_gpu_prune --plot OUT/bench_gpu_prune.json`
# draws it later).
set -eu
if [ $# -lt 1 ]; then
    echo "usage: sh bench/gpu_prune.sh OUT [--shape tiny] [--keeps 0.8,0.63] [...]" >&2
    exit 2
fi
OUT=$1
shift
PY=${PYTHON:-python3}
mkdir -p "$OUT"
"$PY" - <<'EOF'
import importlib, sys
missing = []
# the runtime first: it imports llama_cpp before anything loads the C++ runtime (runtime/llama/cxxruntime.py)
for mod in ("comfyui_a3b.runtime", "llama_cpp", "numpy", "yaml", "tqdm", "gguf"):
    try:
        importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - report every missing piece at once
        missing.append(f"{mod} ({e.__class__.__name__}: {e})")
if missing:
    sys.exit("cannot import: " + "; ".join(missing) + ". Put the repository's parent folder and the folder the "
             "wheels were installed to on PYTHONPATH.")
import llama_cpp
from comfyui_a3b.runtime.llama.devices import gpus
print("llama-cpp-python", llama_cpp.__version__, "GPU offload:", bool(llama_cpp.llama_supports_gpu_offload()),
      "devices:", ", ".join(f"{g.description} ({g.free_bytes / 2**30:.0f} GiB free)" for g in gpus()) or "none")
EOF
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
{ "$PY" -m comfyui_a3b.bench.bench_gpu_prune --out "$OUT" "$@"; echo $? > "$OUT/.rc"; } 2>&1 | tee "$OUT/bench_gpu_prune.log"
rc=$(cat "$OUT/.rc")
rm -f "$OUT/.rc"
exit "$rc"
