#!/usr/bin/env bash
# Sets up .venv, checks lint and format, and runs the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -n 2 "$@"
