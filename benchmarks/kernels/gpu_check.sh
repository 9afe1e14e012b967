#!/usr/bin/env bash
# rlblocks.kernels on one GPU (sized for one H200): correctness, then the GPU benchmark. Target: < 8 minutes.
#
#   bash benchmarks/kernels/gpu_check.sh            # from the repository root (or anywhere)
#   OUT=runs/gpu_check PY=python bash benchmarks/kernels/gpu_check.sh
#
# Step 1 (~1-2 min): tests/kernels/test_gpu.py — the Triton kernels on CUDA (fp32 at 1e-5, bf16 at DESIGN §3
#   tolerances) against float64 references, plus the CPU/interpreter-independent torch-path tests.
# Step 2 (~4-5 min): python -m rlblocks.kernels.bench --suite gpu: naive / torch.compile chunked / liger / rlblocks,
#   modes fwd, bwd, full, nograd, entropy on/off, 30 interleaved samples, TF/s and % of 989.4 TF/s bf16 peak,
#   peak memory above inputs, max error vs fp64. Writes $OUT/kernels_gpu.csv and .json; the log has side-by-side
#   ratios vs naive. The goal row is T=8192 H=4096 V=131072 bf16 (>= 60% fwd, >= 50% full, memory <= 1/8 naive).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python; fi
fi
OUT="${OUT:-runs/gpu_check_kernels}"
mkdir -p "$OUT"
unset TRITON_INTERPRET  # real kernels, not the CPU interpreter
START=$(date +%s)

"$PY" - <<'PY' | tee "$OUT/env.txt"
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA device"
print("gpu:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    raise SystemExit("triton is not installed (pip install rlblocks[kernels])")
PY

echo "== 1/2 correctness (CUDA) =="
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py \
  tests/kernels/test_linear_token_logprobs.py tests/kernels/test_errors_and_backends.py \
  2>&1 | tee "$OUT/tests.txt"

echo "== 2/2 benchmark (suite gpu) =="
timeout 330 "$PY" -m rlblocks.kernels.bench --suite gpu --samples "${SAMPLES:-30}" --out "$OUT" \
  2>&1 | tee "$OUT/bench.txt"

echo "done in $(( $(date +%s) - START )) s; results in $OUT"
