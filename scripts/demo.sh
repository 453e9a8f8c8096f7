#!/usr/bin/env bash
# Main job: install, then a short real DLGS training run (4 simulated workers on
# CPU devices, the CIFAR-10 images embedded in the package). Extra flags go to
# `python -m dlgs_jax.cli.demo` (see --help; any dlgs-train flag overrides the preset).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh train
exec .venv/bin/python -m dlgs_jax.cli.demo "$@"
