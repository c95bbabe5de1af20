#!/usr/bin/env bash
# Sets up .venv, checks lint and format, builds the docs (warnings are errors) and runs the
# whole test suite on the CPU, the Python blocks of the README and docs/ among them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/docs.sh
.venv/bin/python -m pytest -n 2 "$@"
