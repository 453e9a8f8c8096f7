#!/usr/bin/env bash
# Builds the documentation site into docs/_build/html, executing its notebook
# pages on CPU; any warning fails the build. Installs the docs extra first.
#
#   bash scripts/docs.sh          # then open docs/_build/html/index.html
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh docs
rm -rf docs/_build docs/_autosummary
exec .venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html "$@"
