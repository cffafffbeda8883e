#!/usr/bin/env bash
# scripts/gpu_check.sh past the device's 10-minute call limit: the run goes on in its own process session (which
# the device lets outlive the call that started it, while the machine stays warm), and each later call waits on it.
#   scripts/gpu_detached.sh start [OPS...]   start gpu_check.sh (its knobs from the environment), then wait as poll
#   scripts/gpu_detached.sh poll              wait until it ends or POLL_S seconds (default 560) pass
# Either way the call returns with the run's files as they stand copied to $OUT (the logs and results.log while it
# runs, report.tgz and the rest once it ends) and prints its last lines. The machine goes back 30 s after a call
# returns with no next call: chain the polls at once, or the run is lost with the machine.
set -u
cd "$(dirname "$0")/.."
RUN=/tmp/gpu_detached
case "${1:-}" in
  start)
    shift
    rm -rf "$RUN" && mkdir -p "$RUN/out"
    OUT="$RUN/out" setsid nohup bash -c 'bash scripts/gpu_check.sh "$@"; echo "gpu_check exit: $?" > '"$RUN"'/done' \
      gpu_check "$@" > "$RUN/driver.log" 2>&1 < /dev/null &
    ;;
  poll) ;;
  *) echo "usage: $0 start [OPS...] | poll" >&2; exit 2 ;;
esac
[ -d "$RUN" ] || { echo "no detached run on this machine (a fresh machine: the earlier one went back)"; exit 3; }
end=$(( $(date +%s) + ${POLL_S:-560} ))
while [ ! -f "$RUN/done" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
OUT_DIR=${OUT:-/tmp/tilefuse_out}
mkdir -p "$OUT_DIR"
# While it runs, the report and the files a resume needs (the device returns at most 8 files); once it ends,
# gpu_check.sh has packed everything into at most 8.
if [ -f "$RUN/done" ]; then
  cp "$RUN"/out/* "$OUT_DIR"/ 2>/dev/null
  cat "$RUN/done"
else
  for f in report.log report.tgz tests.log results.log; do cp "$RUN/out/$f" "$OUT_DIR"/ 2>/dev/null; done
  cp "$RUN"/out/host_profile_*.txt "$RUN"/out/*.json "$OUT_DIR"/ 2>/dev/null
  echo "still running"
fi
for f in report.log tests.log; do
  [ -f "$RUN/out/$f" ] && { echo "== $f"; grep -v -e UserWarning -e "return torch" "$RUN/out/$f" | tail -8; }
done
exit 0
