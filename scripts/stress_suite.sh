#!/usr/bin/env bash
# Runs the README's test command with one busy process per core competing for the whole run, as on
# a CI runner whose cores are shared; repeats it and prints each run's time and result.
#
#   bash scripts/stress_suite.sh [RUNS] [TIMEOUT_SCALE]     # defaults: 1 run, scale 3
#
# The busy processes are plain `yes > /dev/null` loops (one per core the suite may use), started
# before the run and killed after it, whatever happens. V1ENGINE_TEST_TIMEOUT_SCALE (see
# tests/timeouts.py) multiplies every time limit in the tests; a loaded machine needs more time for
# the same work, never different behaviour. Exit status: that of the last failing run, else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-1}
export V1ENGINE_TEST_TIMEOUT_SCALE=${2:-3}
num_cores=$(python3 -c 'import os; print(len(os.sched_getaffinity(0)))')
busy=()
stop_busy() { for pid in "${busy[@]}"; do kill "$pid" 2>/dev/null; done; wait 2>/dev/null; }
trap stop_busy EXIT
for _ in $(seq "$num_cores"); do
  yes > /dev/null &
  busy+=($!)
done
echo "stress_suite: $num_cores busy process(es), timeout scale $V1ENGINE_TEST_TIMEOUT_SCALE, $runs run(s)"
status=0
for run in $(seq "$runs"); do
  start=$(date +%s)
  # The README's test command, verbatim.
  bash scripts/setup.sh && .venv/bin/python -m pytest -q -p no:cacheprovider
  rc=$?
  echo "stress_suite: run $run exited $rc after $(( $(date +%s) - start )) s"
  [ "$rc" -eq 0 ] || status=$rc
done
exit "$status"
