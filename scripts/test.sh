#!/usr/bin/env bash
# Sets up .venv, checks lint and format, builds the docs (warnings are errors) and runs the
# whole test suite on the CPU, the Python blocks of the README and docs/ among them: the floor,
# Python 3.11 with the lowest jax, flax and optax that pyproject.toml allows (constraints/
# floor.txt). With --newest, the whole suite on Python 3.13 with the newest of them instead
# (scripts/test-newest.sh). Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --newest ]; then
  shift
  exec bash scripts/test-newest.sh "$@"
fi
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# JAX's CUDA plugin (no CUDA libraries), for tests/test_h100_compiled.py to compile for a
# described H100: kept out of .venv, where every jax process without an NVIDIA driver would
# log that it found none. Installed once per jaxlib version (the plugin is released with
# jaxlib, version for version), on Linux x86_64 (its only wheels).
if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
  plugin=.venv/h100-plugin
  jaxlib_version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("jaxlib"))')
  if [ "$(cat "$plugin/.jaxga-installed" 2>/dev/null)" != "$jaxlib_version" ]; then
    echo "test: installing JAX's CUDA plugin $jaxlib_version into $plugin (once)" >&2
    rm -rf "$plugin"
    # its one dependency is the pjrt package; the CUDA libraries are an extra not taken
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
      --target "$plugin" "jax-cuda12-plugin==$jaxlib_version" "jax-cuda12-pjrt==$jaxlib_version"
    printf '%s' "$jaxlib_version" > "$plugin/.jaxga-installed"
  fi
  export JAXGA_H100_PLUGIN=$PWD/$plugin
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/docs.sh
.venv/bin/python -m pytest -n 2 "$@"
