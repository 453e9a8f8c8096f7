#!/usr/bin/env bash
# Install with the test extra, then run the test suite. pytest's "no tests
# collected" (exit 5, e.g. for an empty -k selection) counts as success; any
# failure fails. Extra arguments go to pytest (after ours, so `-n 0` runs the
# tests in this process).
#
#   bash scripts/test.sh          # the full suite (what CI runs)
#   bash scripts/test.sh --fast   # the fast lane: no multi-process, cluster or slow tests
#
# Where the time goes (CPU seconds per test, children included):
#   DLGS_TEST_CPU_DIR=/tmp/cpu bash scripts/test.sh -p tests.cpu_time
#   .venv/bin/python -m tests.cpu_time /tmp/cpu
#
# One pytest worker per core, at most 4 (pytest-xdist): the suite is mostly
# compilation, which runs on one core, and its multi-process tests leave a core
# idle while one process compiles. The emulated-cluster tests stay on one worker
# together.
set -uo pipefail
cd "$(dirname "$0")/.."
lane=()
if [ "${1:-}" = "--fast" ]; then
  shift
  lane=(-m "not multiprocess and not cluster and not slow")
fi
bash scripts/setup_env.sh test || exit 1
.venv/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup "${lane[@]}" "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests for this selection"
  exit 0
fi
exit "$status"
