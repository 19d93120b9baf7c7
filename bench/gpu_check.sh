#!/usr/bin/env bash
# GPU check for the kernels package, for a bare NVIDIA H200 host with this working tree copied over.
#   1. installs the project (pip install -e '.[dev]'; falls back to what is already installed when
#      the host is offline)
#   2. runs the kernel tests with real Triton on CUDA (they parametrize to cuda/bf16 by themselves)
#   3. runs the MoE-layer benchmark on CUDA in bf16, printing TFLOP/s and GB/s beside the H200
#      peaks (~790 TFLOP/s bf16 dense, 4.8 TB/s HBM); writes bench/results/moe_layer_cuda.json
# Budget: under 8 minutes (step timeouts 120 + 45 + 160 + 150 s). Results and logs land in ${OUT:-bench/results}.
#
#     bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
started=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - started ))s] $*"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi unavailable"

step "install"
if ! timeout 120 "$PY" -m pip install -q -e '.[dev]' 2>&1 | tail -5; then
    echo "pip install -e '.[dev]' failed (offline host?): installing the project alone, using what is installed"
    timeout 45 "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -5 || true
fi
"$PY" - <<'EOF'
import sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}")
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch: this script checks the GPU path only")
import triton
import transformers
print(f"triton {triton.__version__}, transformers {transformers.__version__}, device {torch.cuda.get_device_name()}")
EOF

step "kernel tests on CUDA (Triton compiled, bf16 + fp32)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET MOE_KERNELS
test_status=0
timeout 160 "$PY" -m pytest tests/test_kernels_*.py -q -p no:cacheprovider --timeout 150 -rs \
    --junitxml "$RESULTS/gpu_kernel_tests.xml" 2>&1 | tee "$RESULTS/gpu_kernel_tests.log" | tail -30 \
    || test_status=$?

step "MoE layer benchmark on CUDA (bf16)"
bench_status=0
timeout 150 "$PY" bench/bench_moe_layer.py --device cuda --dtype bf16 \
    --out "$RESULTS/moe_layer_cuda.json" 2>&1 | tee "$RESULTS/moe_layer_cuda.log" || bench_status=$?

step "done: tests exit ${test_status}, benchmark exit ${bench_status}"
exit $(( test_status != 0 || bench_status != 0 ))
