#!/usr/bin/env bash
# Install with the test extra, then run the test suite. pytest's "no tests
# collected" (exit 5, e.g. for an empty -k selection) counts as success; any
# failure fails. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test || exit 1
.venv/bin/python -m pytest -q "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests for this selection"
  exit 0
fi
exit "$status"
