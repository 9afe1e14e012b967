#!/usr/bin/env bash
# rlblocks.kernels on one H200-class GPU, in one go from a cold Triton cache (about 8 minutes).
#
#   bash benchmarks/kernels/gpu_check.sh              # on the GPU machine (from the repository root or anywhere)
#   bash benchmarks/kernels/gpu_check.sh --validate   # on a CPU machine: every step at toy size (CI runs this)
#
# It needs no package registry and no virtual environment: it runs the machine's own python3 (torch + CUDA, triton,
# pytest, ...) with PYTHONPATH=<repo>. liger-kernel (>= 0.8.2; older versions give
# wrong gradients with reduction="none") travels as a wheel in the git-ignored .whl/ folder and is installed into
# /tmp/site with pip --no-index. Fetch it once on a machine with the registry, from the repository root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "liger-kernel>=0.8.2"
# and copy .whl/ to the GPU machine with the repository. Without the wheel the liger rows say "skipped".
#
# Steps (none aborts the others; each has its own time limit, and results are written as they are measured):
#   1 env      python, torch, CUDA, GPU, triton and liger versions
#   2 liger    install the wheel from .whl/
#   3 large    the large case first: T=8192 H=4096 V=131072 bf16, naive / liger / liger_sum / rlblocks /
#              rlblocks_fused, forward and forward+backward
#   4 tests    tests/kernels/test_gpu.py: the Triton kernels on CUDA against float64 references; the prefix-shared
#              forward's FlexAttention BlockMask against the dense mask (tests/kernels/test_prefix_share.py);
#              tests/kernels/test_gpu_context_parallel.py: the ring attention's flash blocks and merge in bf16
#   4b cp      context parallelism (benchmarks/kernels/context_parallel.py): one 32k-token sequence of random
#              Qwen3-0.6B-like weights, fwd+bwd peak memory per rank and time at CP = 1 and, over NCCL with one GPU
#              per rank, CP = 2 and 4 where the GPUs exist; with fewer GPUs the one-device shard math of CP = 2, 4
#              (every rank's ring rounds in turn, flash kernels, against SDPA: error and time)
#   5 vllm fp8 tests/rollout/engines/vllm/test_vllm_fp8.py -m gpu: VLLMEngine on a block-FP8 checkpoint written by
#              rlblocks.sync.save_fp8_checkpoint, FP8 updates loaded and checked against HF on the dequantised
#              weights (skipped when the machine's python3 has no vllm; its log is appended to tests.log)
#   6 prefix   benchmarks/kernels/prefix_share.py at a Qwen3-0.6B-like shape (random weights, bf16,
#              FlexAttention): a group of 16, prompt 1024, one row per sample vs packed vs prefix-shared
#              (at most 100 s, taken from what step 7 would otherwise get)
#   7 more     entropy and no-grad at the large shape, then V=151936 H=896, V=32000, V=128256 H=8192
#   8 table    the summary table of every measured row (TF/s and % of 989 TF/s with 6NHV for forward+backward,
#              the executed-FLOPs TF/s, memory as a multiple of the bf16 logits, max error against float64)
# Output under $OUT (11 files): summary.txt, large.log, tests.log, prefix.log, more.log, context_parallel.{log,json},
# kernels_gpu-large.{csv,json}, kernels_gpu-more.{csv,json}. Env: PY (python3), OUT, SAMPLES (20), BUDGET_S (480).
set -uo pipefail  # no -e: a failing step is recorded and the next one runs

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2
MODE=gpu
if [[ "${1:-}" == "--validate" ]]; then MODE=validate; fi
PY="${PY:-python3}"
OUT="${OUT:-runs/gpu_check_kernels}"
SAMPLES="${SAMPLES:-20}"
BUDGET_S="${BUDGET_S:-480}"
mkdir -p "$OUT"
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PYTHONPATH="$ROOT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the real kernels (in --validate: the torch path on CPU tensors)
FAILED=0

note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
# step NAME LIMIT_S LOG CMD...: run CMD under `timeout`, tee its output to LOG, record the outcome
step() {
  local name="$1" limit="$2" log="$3"; shift 3
  local t0 rc
  t0=$(date +%s)
  if (( limit < 5 )); then note "== $name: skipped (time budget spent)"; FAILED=1; return; fi
  note "== $name (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if (( rc == 0 )); then note "== $name: ok ($(( $(date +%s) - t0 )) s)"
  else note "== $name: FAILED rc=$rc ($(( $(date +%s) - t0 )) s; 124 = time limit)"; FAILED=1; fi
}

# 1 env
note "rlblocks.kernels gpu_check ($MODE) $(date -u +%Y-%m-%dT%H:%M:%SZ) in $ROOT"
"$PY" - "$MODE" <<'PY' 2>&1 | tee -a "$SUMMARY"
import sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed")
if sys.argv[1] == "gpu" and not torch.cuda.is_available():
    raise SystemExit("gpu_check.sh needs a CUDA device (use --validate on a CPU machine)")
PY
if (( ${PIPESTATUS[0]} != 0 )); then note "== env: FAILED"; exit 2; fi

# 2 liger from the wheel in .whl/
SITE=/tmp/site
if [[ "$MODE" == validate ]]; then SITE="$(mktemp -d)"; fi
if compgen -G ".whl/liger_kernel-*.whl" > /dev/null; then
  step "2/8 liger install" 120 "$OUT/summary.liger.tmp" \
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  cat "$OUT/summary.liger.tmp" >> "$SUMMARY"; rm -f "$OUT/summary.liger.tmp"
  export PYTHONPATH="$ROOT:$SITE"
  "$PY" -c "from importlib.metadata import version; print('liger-kernel', version('liger-kernel'))" 2>&1 \
    | tee -a "$SUMMARY"
else
  note "== 2/8 liger: skipped (no .whl/liger_kernel-*.whl; the liger rows will say so)"
fi

PREFIX_TEST=tests/kernels/test_prefix_share.py::test_flex_matches_dense_on_cuda
if [[ "$MODE" == validate ]]; then
  LARGE=(--suite validate --samples 2 --modes fwd,full)
  MORE=(--suite validate --samples 2 --modes bwd,nograd)
  TESTS=(-m pytest -q -p no:cacheprovider --collect-only tests/kernels/test_gpu.py "$PREFIX_TEST"
         tests/kernels/test_gpu_context_parallel.py)
  PREFIX=(--preset tiny --cases group16 --scale 0.05 --samples 1)
  CP=(--device cpu --model tiny --lengths 512 --cp 1,2)
  CSV_LARGE="$OUT/kernels_validate.large.csv"; CSV_MORE="$OUT/kernels_validate.more.csv"
else
  LARGE=(--suite gpu-large --samples "$SAMPLES")
  MORE=(--suite gpu-more --samples "$SAMPLES")
  TESTS=(-m pytest -q -p no:cacheprovider --timeout 100 tests/kernels/test_gpu.py "$PREFIX_TEST"
         tests/kernels/test_gpu_context_parallel.py)
  PREFIX=(--preset qwen3-0.6b --cases group16 --samples 2)
  CP=(--device cuda --model qwen3-0.6b --lengths 32768 --cp 1,2,4)
  CSV_LARGE="$OUT/kernels_gpu-large.csv"; CSV_MORE="$OUT/kernels_gpu-more.csv"
fi

# 3 the large case first (cold compile + autotune of the kernels included)
lim=$(( $(left) < 200 ? $(left) : 200 ))
step "3/8 large case" "$lim" "$OUT/large.log" "$PY" benchmarks/kernels/bench.py "${LARGE[@]}" --out "$OUT" \
  --time-budget-s $(( lim - 40 ))
if [[ "$MODE" == validate ]]; then mv -f "$OUT/kernels_validate.csv" "$CSV_LARGE"; fi

# 4 correctness on CUDA
lim=$(( $(left) - 120 < 150 ? $(left) - 120 : 150 ))
step "4/8 tests" "$lim" "$OUT/tests.log" "$PY" "${TESTS[@]}"

# 4b context parallelism (the table goes into the summary too)
lim=$(( $(left) - 90 < 120 ? $(left) - 90 : 120 ))
step "4b/8 context parallel" "$lim" "$OUT/context_parallel.log" "$PY" benchmarks/kernels/context_parallel.py \
  "${CP[@]}" --json "$OUT/context_parallel.json"
sed -n '/^ tokens /,$p' "$OUT/context_parallel.log" >> "$SUMMARY"

# 5 block-FP8 in a real vLLM engine (GPU only; needs vllm in this python3)
if "$PY" -c "import vllm" > /dev/null 2>&1; then
  if [[ "$MODE" == validate ]]; then
    FP8=(-m pytest -q -p no:cacheprovider --collect-only tests/rollout/engines/vllm/test_vllm_fp8.py)
  else
    FP8=(-m pytest -q -p no:cacheprovider -m gpu --timeout 170 tests/rollout/engines/vllm/test_vllm_fp8.py)
  fi
  lim=$(( $(left) - 90 < 180 ? $(left) - 90 : 180 ))
  step "5/8 vllm fp8" "$lim" "$OUT/fp8.tmp" "$PY" "${FP8[@]}"
  { echo "== vllm fp8"; cat "$OUT/fp8.tmp"; } >> "$OUT/tests.log"; rm -f "$OUT/fp8.tmp"
else
  note "== 5/8 vllm fp8: skipped (no vllm in $PY)"
fi

# 6 prefix-shared training forward (FlexAttention compiles on its first call: part of the limit)
lim=$(( $(left) - 90 < 100 ? $(left) - 90 : 100 ))
step "6/8 prefix share" "$lim" "$OUT/prefix.log" "$PY" benchmarks/kernels/prefix_share.py "${PREFIX[@]}"
grep -E "^(##|way|padded|packed|shared) " "$OUT/prefix.log" >> "$SUMMARY"

# 6 the other cases, with what is left
lim=$(( $(left) - 15 ))
step "7/8 more cases" "$lim" "$OUT/more.log" "$PY" benchmarks/kernels/bench.py "${MORE[@]}" --out "$OUT" \
  --time-budget-s $(( lim - 40 ))
if [[ "$MODE" == validate ]]; then mv -f "$OUT/kernels_validate.csv" "$CSV_MORE"; rm -f "$OUT/kernels_validate.json"; fi

# 8 the table, from the rows written so far
note "== 8/8 table ($(( $(date +%s) - START )) s elapsed)"
"$PY" benchmarks/kernels/bench.py --table-from "$CSV_LARGE" "$CSV_MORE" 2>&1 | tee -a "$SUMMARY"
if (( FAILED )); then note "gpu_check: some steps FAILED (see above)"; exit 1; fi
note "gpu_check: all steps ok in $(( $(date +%s) - START )) s"
