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
