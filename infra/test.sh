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
.venv/bin/ember dev up
if [ -n "${CI:-}" ]; then
  trap '.venv/bin/ember dev down >/dev/null 2>&1 || true' EXIT
fi
set +e
.venv/bin/python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests; an empty run is a failure, not a pass" >&2
  exit 1
fi
exit "$status"
