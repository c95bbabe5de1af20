#!/usr/bin/env bash
# Sets up .venv, checks lint and format, builds the docs (warnings are errors) and runs the
# whole test suite on the CPU, the Python blocks of the README and docs/ among them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# JAX's CUDA plugin (no CUDA libraries), for tests/test_h100_compiled.py to compile for a
# described H100: kept out of .venv, where every jax process without an NVIDIA driver would
# log that it found none. Installed once per jax version, on Linux x86_64 (its only wheels).
if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
  plugin=.venv/h100-plugin
  jax_version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("jax"))')
  if [ "$(cat "$plugin/.jaxga-installed" 2>/dev/null)" != "$jax_version" ]; then
    echo "test: installing JAX's CUDA plugin $jax_version into $plugin (once)" >&2
    rm -rf "$plugin"
    # its one dependency is the pjrt package; the CUDA libraries are an extra not taken
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
      --target "$plugin" "jax-cuda12-plugin==$jax_version" "jax-cuda12-pjrt==$jax_version"
    printf '%s' "$jax_version" > "$plugin/.jaxga-installed"
  fi
  export JAXGA_H100_PLUGIN=$PWD/$plugin
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/docs.sh
.venv/bin/python -m pytest -n 2 "$@"
