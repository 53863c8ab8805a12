#!/usr/bin/env bash
# `make test`: the unit tests run beside the integration suite, in a second pytest process.
#
# The integration suite keeps one local Ray cluster and its CLI runs busy, but not both cores all the time
# (vLLM start-ups wait on each other, runs wait on deadlines); the unit tests (no Ray, no vLLM) fill that
# room instead of running after it. Their output is printed when both have finished; the exit code is the
# first failure's. With arguments (`make test ARGS=...`) one plain pytest runs them.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYTEST=("$PY" -m pytest -q -rs --tb=short)

if [ $# -gt 0 ]; then
    exec "${PYTEST[@]}" --durations=15 "$@"
fi

unit_log=$(mktemp)
"${PYTEST[@]}" --durations=10 -m "not integration" -p no:cacheprovider >"$unit_log" 2>&1 &
unit=$!
# an interrupted `make test` stops the unit tests too (by pid), and leaves no log behind
trap 'kill "$unit" 2>/dev/null; rm -f "$unit_log"' EXIT

start=$SECONDS
"${PYTEST[@]}" --durations=15 -m integration
integration_rc=$?
wait "$unit"
unit_rc=$?
echo
echo "================ unit tests (run beside the integration tests) ================"
cat "$unit_log"
echo "make test: integration exit code $integration_rc, unit exit code $unit_rc, $((SECONDS - start)) s in all"
if [ "$integration_rc" -ne 0 ]; then exit "$integration_rc"; fi
exit "$unit_rc"
