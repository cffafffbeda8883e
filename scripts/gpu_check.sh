#!/usr/bin/env bash
# The one command sent to the H200:  scripts/gpu_check.sh [OPS...]
# Runs the GPU tests and `tilefuse report` for the named registry ops (all when none are named), inside
# its own time limit so partial results still come back, and packs everything under $OUT (the device
# tool returns at most 8 files, at most 2 folders deep: the report folder travels as one tar).
# Knobs (environment): GPU_CHECK_LIMIT total seconds (default 540), TESTS=0 to skip tests, TESTS_LIMIT
# seconds for them, REPORT=0 to skip the report, SANITIZE=1 to run compute-sanitizer memcheck over the
# tests matching SAN_K (default test_linear) in SAN_FILES (default: tests),
# CACHE_OUT=1 to return the Triton cache, a carried .carry/results*.log to skip tests that passed in an
# earlier call (each call writes $OUT/results.log: outcome, seconds and id of every test as it ends),
# TEST_K a pytest -k expression for the tests, TEST_FILES the test files (default: tests; the registry grid
# runs after the other files, REGISTRY_AFTER_SHARE percent of the tests' time given to those first),
# TILEFUSE_REGISTRY_STRIDE=k to run every k-th registry-grid case (tests/conftest.py),
# HOST_PER_OP=1 to time the host side of every op first (benchmarks/host_per_op.py: this tree with and
# without the launch layer's fast path, and the tree carried in .carry/old/src when there is one),
# REPORT_FIRST=1 to run the report before the tests (a cold Triton cache, as a user's first run has), REPORT_LIMIT
# seconds for it,
# TILEFUSE_BACKEND=tilefuse|vendor runs the tests (and the report) under that backend (carry only result logs of
# the same backend: a test that passed under one has not run under another),
# REPORT_ARGS extra arguments for `tilefuse report`, split as a shell would (quotes group words, no globbing:
# REPORT_ARGS="--anchors 'eager unfused' 'torch.compile.*'"), LABS=1 to run the Gluon labs' benches after the tests
# (benchmarks/gemm_coop_ws.py bench and forward, attention_bwd_wide.py and decode_gemv.py bench), or LABS="lab:command ..." for
# some of them (e.g. LABS="gemm_coop_ws:forward"); LAB_LIMIT seconds each (default 150), each into
# $OUT/lab_<lab>_<command>.jsonl.
# BENCHES (below) for benchmark scripts that write JSON.
# HOST_PROFILES=1 to profile the host side of the rows the default backend trails on by host time, after the report
# (benchmarks/host_profile.py: linear_train M512, linear M64, layer_norm_linear's rms row at K 768), each into
# $OUT/host_profile_<op>.txt.
set -u
source "$(dirname "$0")/device_env.sh"
# A Triton cache carried in from an earlier call (.carry/triton_cache.tgz) skips recompiling.
[ -f .carry/triton_cache.tgz ] && tar xzf .carry/triton_cache.tgz -C "$TRITON_CACHE_DIR" 2>/dev/null
LIMIT=${GPU_CHECK_LIMIT:-540}
START=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - START) )); }
OPS=("$@")
{ nvidia-smi; python3 -m tilefuse info; git log -1 --oneline 2>/dev/null; echo "ops: ${OPS[*]:-all}"; } > "$OUT/env.txt" 2>&1

if [ "${HOST_PER_OP:-0}" = 1 ]; then
  timeout 240 python3 benchmarks/host_per_op.py --out "$OUT/host_new.json" > "$OUT/host.log" 2>&1
  timeout 120 python3 benchmarks/host_per_op.py --no-fastpath --out "$OUT/host_new_full.json" >> "$OUT/host.log" 2>&1
  if [ -d .carry/old/src ]; then
    PYTHONPATH="$PWD/.carry/old/src" timeout 240 python3 benchmarks/host_per_op.py --out "$OUT/host_old.json" >> "$OUT/host.log" 2>&1
  fi
  echo "host per op exit: $?" >> "$OUT/host.log"
  tail -3 "$OUT/host.log"
fi
run_report() {  # `tilefuse report` for OPS into $OUT/report.tgz, inside what is left of the limit
  REPORT_ARGV=()
  if [ -n "${REPORT_ARGS:-}" ]; then set -f; eval "REPORT_ARGV=(${REPORT_ARGS})"; set +f; fi
  local limit=$(( $(left) - 25 ))
  [ -n "${REPORT_LIMIT:-}" ] && [ "$REPORT_LIMIT" -lt "$limit" ] && limit=$REPORT_LIMIT
  timeout "$limit" python3 -m tilefuse report --no-progress --out "$OUT/report" \
    ${OPS[@]:+--ops "${OPS[@]}"} ${REPORT_ARGV[@]+"${REPORT_ARGV[@]}"} > "$OUT/report.log" 2>&1
  echo "report exit: $?" >> "$OUT/report.log"
  tail -3 "$OUT/report.log"
  # This call's rows as the results table; after committing the report, regenerate benchmarks/RESULTS.md
  # over the latest committed reports (benchmarks/results_table.py).
  [ -f "$OUT/report/report.json" ] && python3 benchmarks/results_table.py "$OUT/report/report.json" --out "$OUT/RESULTS.md" >/dev/null
  tar czf "$OUT/report.tgz" -C "$OUT" report && rm -rf "$OUT/report"
}
if [ "${REPORT:-1}" = 1 ] && [ "${REPORT_FIRST:-0}" = 1 ]; then run_report; fi
if [ "${HOST_PROFILES:-0}" = 1 ]; then
  for row in "linear_train|M512 " "linear|M64 " "layer_norm_linear|M16384 K768 N2304 rms"; do
    op=${row%%|*}
    timeout 90 python3 benchmarks/host_profile.py --op "$op" --case "${row#*|}" --calls 300 --rows 40 --torch-profiler \
      > "$OUT/host_profile_$op.txt" 2>&1
    echo "host profile exit: $?" >> "$OUT/host_profile_$op.txt"
    head -1 "$OUT/host_profile_$op.txt"
  done
fi
# BENCHES="name ..." runs benchmarks/<name>.py --out $OUT/<name>.json for each (e.g. cross_entropy_head, the LM-head
# loss's time and peak memory), after the report when it runs first; BENCH_LIMIT seconds each (default 240).
for bench in ${BENCHES:-}; do
  timeout "${BENCH_LIMIT:-240}" python3 "benchmarks/$bench.py" --out "$OUT/$bench.json" > "$OUT/bench_$bench.log" 2>&1
  echo "bench $bench exit: $?" >> "$OUT/bench_$bench.log"
  tail -1 "$OUT/bench_$bench.log"
done
K_EXPR=${TEST_K:-}   # pytest -k expression; default: the whole suite
if [ "${TESTS:-1}" = 1 ]; then
  # Tests pin each kernel to its first config (TILEFUSE_AUTOTUNE=0): hundreds of small shapes must not
  # each benchmark a config space. The tuned configs are exercised, with an accuracy check per row, by
  # the report below.
  # Resume: tests recorded as passed in carried result logs (.carry/results*.log) are not run again.
  SKIP_PASSED=$(ls .carry/results*.log 2>/dev/null | paste -sd: -)
  TESTS_END=$(( $(date +%s) + ${TESTS_LIMIT:-$(( $(left) / 2 ))} ))
  # never past the call's own limit (less 20 s to pack the files): what the report and benches left
  [ "$TESTS_END" -gt $(( START + LIMIT - 20 )) ] && TESTS_END=$(( START + LIMIT - 20 ))
  # The registry grid (tests/test_registry_ops.py) runs after the other files: xdist schedules its grouped
  # cases first, and alone it fills any time limit. The other files get REGISTRY_AFTER_SHARE percent of the
  # tests' time (default 50) and hand back what they leave.
  FILES=${TEST_FILES:-tests}
  OTHERS=() REGISTRY=()
  for f in $FILES; do
    case "$f" in
      tests|tests/) OTHERS+=(tests --ignore=tests/test_registry_ops.py); REGISTRY+=(tests/test_registry_ops.py) ;;
      *test_registry_ops.py) REGISTRY+=("$f") ;;
      *) OTHERS+=("$f") ;;
    esac
  done
  run_tests() {  # $1: seconds, $2: log suffix, then the files
    local limit=$1 tag=$2; shift 2
    TILEFUSE_SKIP_PASSED="$SKIP_PASSED" TILEFUSE_RESULT_LOG="$OUT/results.log" \
    TILEFUSE_FAIL_LOG="$OUT/failures.log" TILEFUSE_AUTOTUNE=0 timeout "$limit" python3 -m pytest -q -n "${WORKERS:-12}" --dist loadgroup -p no:cacheprovider "$@" ${K_EXPR:+-k "$K_EXPR"} \
      --junitxml="$OUT/tests$tag.xml" >> "$OUT/tests.log" 2>&1
    echo "tests$tag exit: $?" >> "$OUT/tests.log"
  }
  : > "$OUT/tests.log"
  if [ ${#OTHERS[@]} -gt 0 ]; then
    share=$(( (TESTS_END - $(date +%s)) * ${REGISTRY_AFTER_SHARE:-50} / 100 ))
    [ ${#REGISTRY[@]} -eq 0 ] && share=$(( TESTS_END - $(date +%s) ))
    run_tests "$share" "" "${OTHERS[@]}"
  fi
  if [ ${#REGISTRY[@]} -gt 0 ] && [ $(( TESTS_END - $(date +%s) )) -gt 10 ]; then
    run_tests "$(( TESTS_END - $(date +%s) ))" "_registry" "${REGISTRY[@]}"
  fi
  tail -3 "$OUT/tests.log"
fi
if [ "${LABS:-0}" != 0 ]; then
  LAB_LIST=${LABS}
  [ "$LAB_LIST" = 1 ] && LAB_LIST="gemm_coop_ws:bench gemm_coop_ws:forward attention_bwd_wide:bench decode_gemv:bench"
  for lab in $LAB_LIST; do
    set -- ${lab%%:*} ${lab#*:}
    timeout "${LAB_LIMIT:-150}" python3 "benchmarks/$1.py" "$2" > "$OUT/lab_$1_$2.jsonl" 2> "$OUT/lab_$1_$2.log"
    echo "lab $1 $2 exit: $?" >> "$OUT/lab_$1_$2.log"
    tail -1 "$OUT/lab_$1_$2.log"
  done
fi
if [ "${SANITIZE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  TILEFUSE_AUTOTUNE=0 timeout "${SANITIZE_LIMIT:-150}" compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 -m pytest -q -x -p no:cacheprovider ${SAN_FILES:-tests} -k "${SAN_K:-test_linear}" > "$OUT/sanitizer.log" 2>&1
  echo "sanitizer exit: $?" >> "$OUT/sanitizer.log"
  tail -3 "$OUT/sanitizer.log"
fi
if [ "${REPORT:-1}" = 1 ] && [ "${REPORT_FIRST:-0}" != 1 ]; then run_report; fi
if [ "${CACHE_OUT:-0}" = 1 ]; then  # the full suite's cache is too large to come back (> 16 MiB)
  tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
  [ "$(stat -c %s "$OUT/triton_cache.tgz")" -gt 15000000 ] && rm -f "$OUT/triton_cache.tgz"
fi
# The device returns at most 8 files: past that, everything but results.log (the next call's carry), the report
# and the cache goes into logs.tgz.
if [ "$(ls -A "$OUT" | wc -l)" -gt 8 ]; then
  (cd "$OUT" && ls -A | grep -v -x -e results.log -e report.tgz -e triton_cache.tgz -e logs.tgz \
     | tar czf logs.tgz --remove-files -T -)
fi
exit 0
