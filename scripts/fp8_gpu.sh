#!/usr/bin/env bash
# The FP8 issue's GPU call: the attention kernels against their emulation, the attention bench and accuracy
# (benchmarks/fp8_attention.py), then scripts/gpu_check.sh over the FP8 test files and the two FP8 registry ops.
# Knobs: CHECK=0 / BENCH=0 / LINEAR=0 (benchmarks/fp8_linear.py) / ACC=0 / GPU_CHECK=0 skip those steps; the rest goes to gpu_check.sh (GPU_CHECK_LIMIT, TESTS...).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tilefuse_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"
[ "${CHECK:-1}" = 1 ] && timeout 100 python3 benchmarks/fp8_attention.py check > "$OUT/fp8_check.jsonl" 2>&1
[ "${BENCH:-1}" = 1 ] && timeout 150 python3 benchmarks/fp8_attention.py bench > "$OUT/fp8_bench.jsonl" 2>&1
[ "${LINEAR:-1}" = 1 ] && timeout 150 python3 benchmarks/fp8_linear.py > "$OUT/fp8_linear.jsonl" 2>&1
[ "${ACC:-1}" = 1 ] && timeout 60 python3 benchmarks/fp8_attention.py accuracy > "$OUT/fp8_accuracy.jsonl" 2>&1
tail -n 4 "$OUT"/fp8_*.jsonl 2>/dev/null
[ "${GPU_CHECK:-1}" = 1 ] && TEST_FILES=${TEST_FILES:-"tests/test_fp8_attention.py tests/test_fp8_linear.py"} \
  bash scripts/gpu_check.sh "$@"
exit 0
