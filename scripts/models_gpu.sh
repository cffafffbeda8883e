#!/usr/bin/env bash
# The models issue's GPU call: `tilefuse bench` runs, each inside its own time limit, into $OUT/<name>/ (JSON, PNG)
# and $OUT/<name>.log, then everything packed into $OUT/models.tgz (the device returns few files).
#   scripts/models_gpu.sh "name|bench args" ...
# e.g.  scripts/models_gpu.sh "gpt2_train|train --model gpt2-small --compile-mode default"
# A name "name@rules" runs that bench with TILEFUSE_COMPILE_RULES=rules ("gpt2@loss=inductor|train ...").
# Knobs: RUN_LIMIT seconds per run (default 240), TESTS="files" to run those GPU tests first (TESTS_LIMIT, default
# 120; TEST_K a pytest -k expression for them), COMPILE_RULES for the patched + compiled variants (TILEFUSE_COMPILE_RULES). Wheels carried in .whl/
# (liger-kernel for its variant) are installed first.
set -u
source "$(dirname "$0")/device_env.sh"
[ -n "${COMPILE_RULES:-}" ] && export TILEFUSE_COMPILE_RULES="$COMPILE_RULES"
{ nvidia-smi; python3 -m tilefuse info; git log -1 --oneline 2>/dev/null; } > "$OUT/env.txt" 2>&1
if [ -n "${TESTS:-}" ]; then
  TILEFUSE_AUTOTUNE=0 timeout "${TESTS_LIMIT:-120}" python3 -m pytest -q -n "${WORKERS:-8}" -p no:cacheprovider $TESTS \
    ${TEST_K:+-k "$TEST_K"} > "$OUT/tests.log" 2>&1
  echo "tests exit: $?" >> "$OUT/tests.log"
  tail -2 "$OUT/tests.log"
fi
# The models issue's table in two calls (torch.compile's default mode in every compiled column, prefill timed over
# 50 forwards): PRESET=train-a (the MLP rows and GPT-2-small training), PRESET=train-b (Llama-1B training and both
# prefill rows).
case "${PRESET:-}" in
  train-a) set -- "mlp_d1024|mlp-train --d 1024 --compile-mode default" \
                 "mlp_d4096|mlp-train --d 4096 --steps 300 --compile-mode default" \
                 "gpt2_train|train --model gpt2-small --compile-mode default" "$@" ;;
  train-b) set -- "llama1b_train|train --model llama-1b --compile-mode default" \
                 "gpt2m_prefill|prefill --model gpt2-medium --repeats 50 --compile-mode default" \
                 "llama7b_prefill|prefill --model llama-7b --repeats 20 --compile-mode default" "$@" ;;
  "") ;;
  *) echo "PRESET must be train-a or train-b, got ${PRESET}" >&2; exit 2 ;;
esac
for run in "$@"; do
  name=${run%%|*}
  set -f; args=(${run#*|}); set +f
  rules=${TILEFUSE_COMPILE_RULES:-}
  case "$name" in *@*) rules=${name#*@}; name=${name%%@*} ;; esac
  start=$SECONDS
  TILEFUSE_COMPILE_RULES="$rules" timeout "${RUN_LIMIT:-240}" python3 -m tilefuse bench "${args[@]}" --no-progress --out "$OUT/$name" \
    > "$OUT/$name.log" 2>&1
  echo "$name exit: $? after $((SECONDS - start)) s" >> "$OUT/$name.log"
  tail -12 "$OUT/$name.log"
done
(cd "$OUT" && ls -A | grep -v -x models.tgz | tar czf models.tgz --remove-files -T -)
exit 0
