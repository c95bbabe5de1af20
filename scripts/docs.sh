#!/usr/bin/env bash
# Builds the documentation site into site/, failing on any warning; `bash scripts/docs.sh serve`
# serves it at http://127.0.0.1:8000 instead, rebuilding on every change. Not --quiet, which
# would hide the warnings (griffe's on the docstrings among them) that fail a strict build: a
# clean build prints three INFO lines, and every warning is printed before the abort.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu} NO_MKDOCS_2_WARNING=1  # the theme's notice of its successor
if [ "${1:-}" = serve ]; then exec .venv/bin/mkdocs serve --strict; fi
.venv/bin/mkdocs build --strict --site-dir site
