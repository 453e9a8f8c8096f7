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
# The emulated-cluster tests need iproute2 (`ip`, `tc`) and the docs test a headless
# Chromium; installed here, as root with apt-get, so that nothing is installed while
# the tests are collected.
missing=()
if [ "$extras" = "test" ]; then
  command -v tc >/dev/null || missing+=(iproute2)
  command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium)
fi
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
    >/dev/null 2>&1 || echo "could not install ${missing[*]}: the tests that need them will be skipped"
fi
