#!/usr/bin/env bash
# The README's test command: set everything up from nothing, start the real services, run the full suite.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
bash infra/setup-env.sh
if ! command -v chromium >/dev/null 2>&1; then
  echo "==> chromium not found: installing Debian's chromium (tests draw the HTML corpus report in headless Chromium)"
  (source infra/common.sh && EMBER_LOG_TAG=test apt_install chromium)
  command -v chromium >/dev/null 2>&1 || { echo "error: apt-get install chromium did not put chromium on PATH" >&2; exit 1; }
fi
echo "==> checking the architecture (import-linter contracts in pyproject.toml)"
.venv/bin/lint-imports --no-cache
# A full disk shows up as dozens of unrelated failures (brokers take their log dir offline, Flink and Beam cannot
# stage): say it first, in one line.
free_kb="$(df -Pk "$REPO" | awk 'NR == 2 {print $4}')"
if [ "${free_kb:-0}" -lt $((8 * 1024 * 1024)) ]; then
  echo "warning: only $((free_kb / 1024)) MiB free on $(df -P "$REPO" | awk 'NR == 2 {print $6}'); the suite's brokers, Flink clusters and builds need several GiB (a full disk fails tests all over)" >&2
fi
.venv/bin/ember dev up
if [ -n "${CI:-}" ]; then
  trap '.venv/bin/ember dev down >/dev/null 2>&1 || true' EXIT
fi
# Two phases: the tests that stop or restart a shared service (marked `serial`) alone, after the rest have run
# on pytest-xdist workers (EMBER_TEST_WORKERS, default 3: most tests wait on Kafka, Slurm or a subprocess, so
# three workers keep two cores busy). Tests that share a one-job service run on one worker (tests/conftest.py).
RESULTS="${EMBER_HOME:-$REPO/.ember}/test-results"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
set +e
echo "==> pytest, parallel phase (${EMBER_TEST_WORKERS:-3} workers)"
EMBER_SERIAL_TESTS="$RESULTS/serial-tests.txt" .venv/bin/python -m pytest -n "${EMBER_TEST_WORKERS:-3}" --dist loadgroup \
  -m "not serial" --junitxml="$RESULTS/parallel.xml" "$@"
parallel=$?
serial=5
if [ -s "$RESULTS/serial-tests.txt" ]; then
  echo "==> pytest, serial phase: $(wc -l < "$RESULTS/serial-tests.txt") tests that stop or restart a shared service"
  mapfile -t serial_tests < "$RESULTS/serial-tests.txt"
  .venv/bin/python -m pytest -p no:xdist -m serial --junitxml="$RESULTS/serial.xml" "${serial_tests[@]}"
  serial=$?
fi
set -e
.venv/bin/python infra/slowest.py 25 "$RESULTS/parallel.xml" "$RESULTS/serial.xml"
if [ "$parallel" -eq 5 ] && [ "$serial" -eq 5 ]; then
  echo "error: pytest collected no tests; an empty run is a failure, not a pass" >&2
  exit 1
fi
for status in "$parallel" "$serial"; do
  if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then
    exit "$status"
  fi
done
