#!/usr/bin/env bash
# Sets up .venv and trains the main example; extra arguments go to examples/train_lm.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_lm.py "$@"
