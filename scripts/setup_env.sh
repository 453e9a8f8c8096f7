#!/usr/bin/env bash
# Creates .venv (once) and installs dlgs_jax into it with the given extras.
# Usage: scripts/setup_env.sh [extras]   e.g. scripts/setup_env.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
extras="${1:-}"
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e "$spec"
# The emulated-cluster tests need iproute2 (`ip`, `tc`); installed here, as root with
# apt-get, so that nothing is installed while the tests are collected.
if [ "$extras" = "test" ] && [ "$(id -u)" = 0 ] && ! command -v tc >/dev/null \
    && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2; } \
    >/dev/null 2>&1 || echo "iproute2 could not be installed: the emulated-cluster tests will be skipped"
fi
