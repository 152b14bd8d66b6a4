#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU, run the GPU and TensorRT tests and the engine latency
# benchmark (FP32 vs FP16 on ONNX Runtime CUDA, and TensorRT when installed), then print a summary.
# Usage: bench/gpu_check.sh [python]   (default: .venv/bin/python if present, else python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$(mktemp -d)"

echo "== machine"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader || {
    echo "nvidia-smi failed: no NVIDIA GPU/driver here; this script needs a GPU machine"; exit 2; }
"$PY" - <<'PYEOF'
import importlib.util
import onnxruntime as ort
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("onnxruntime", ort.__version__, ort.get_available_providers())
if importlib.util.find_spec("tensorrt"):
    try:
        import tensorrt
        print("tensorrt", tensorrt.__version__)
    except Exception as err:  # the registry stub fails on import
        print("tensorrt import failed:", err)
else:
    print("tensorrt not installed: pip install tensorrt, with NVIDIA's package index added as an extra index (NVIDIA's TensorRT install guide gives it)")
PYEOF

echo "== tests: pytest -m 'gpu or tensorrt'"
"$PY" -m pytest -m "gpu or tensorrt" -q -rs -p no:cacheprovider 2>&1 | tee "$LOG/tests.txt" | tail -25
TEST_RC=${PIPESTATUS[0]}

echo "== latency: FP32 vs FP16 engines"
"$PY" bench/engine_latency.py --device cuda 2>&1 | tee "$LOG/latency.txt" | grep -v -i warning
BENCH_RC=${PIPESTATUS[0]}

echo
echo "== summary"
echo "GPU:     $(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader | head -1)"
echo "tests:   $(tail -1 "$LOG/tests.txt")   (exit $TEST_RC)"
echo "latency: exit $BENCH_RC"
grep -E "fp16/fp32|^Latency" "$LOG/latency.txt" || true
echo "Copy the latency table into bench/RESULTS.md with the GPU named."
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
