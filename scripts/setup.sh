#!/usr/bin/env bash
# Creates .venv beside the project (once) and installs jaxga, editable, with its extras into
# it: the floor, jax, flax and optax pinned to the lowest versions pyproject.toml allows by
# constraints/floor.txt, so that what is tested there cannot drift upward. Reinstalls only
# when pyproject.toml or the constraints change. Set JAXGA_EXTRAS=examples,dev,docs,cuda12
# on a GPU box.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
extras=${JAXGA_EXTRAS:-examples,dev,docs}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.jaxga-installed
want="$(cat pyproject.toml constraints/floor.txt) $extras"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing jaxga[$extras] into .venv (first run only)" >&2
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install --quiet --disable-pip-version-check \
    --constraint constraints/floor.txt -e ".[$extras]"
  # JAX's CUDA plugin, which the dev extra once installed, logs in every jax process on a
  # machine without a GPU: out of .venv unless asked for (scripts/test.sh keeps its own copy)
  if [[ ",$extras," != *,cuda12,* ]] \
    && .venv/bin/python -m pip show --quiet jax-cuda12-plugin &>/dev/null; then
    .venv/bin/python -m pip uninstall --quiet --yes jax-cuda12-plugin jax-cuda12-pjrt
  fi
  printf '%s' "$want" > "$stamp"
fi
