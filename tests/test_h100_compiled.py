"""The GPU memory claims of the README and docs/, held on a described NVIDIA H100.

Compiling for a described H100 needs JAX's CUDA plugin, which is kept out of ``.venv``: with
it installed, every jax process on a machine without an NVIDIA driver (the training
command's among them) logs that it found none. ``scripts/test.sh`` installs the plugin
into ``.venv/h100-plugin`` instead and sets ``JAXGA_H100_PLUGIN`` to that folder; the checks
(``tests/h100/checks.py``) run in one pytest subprocess that has it on ``PYTHONPATH``.
"""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ROOT / "tests" / "h100" / "checks.py"
# a hang's limit, not a speed test: far beyond what a loaded 2-core machine needs
TIMEOUT_S = 3000


def plugin_folder() -> Path:
    """The folder holding JAX's CUDA plugin, or a skip with the reason it is absent."""
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        pytest.skip(
            "JAX's CUDA plugin, which compiles for a described H100, has wheels for Linux "
            f"x86_64 only (this is {platform.system()} {platform.machine()})"
        )
    missing = os.environ.get("JAXGA_H100_PLUGIN_MISSING")  # scripts/test-newest.sh's reason
    if missing:
        pytest.skip(missing)
    folder = os.environ.get("JAXGA_H100_PLUGIN")
    if not folder:
        pytest.skip(
            "JAXGA_H100_PLUGIN is unset: run through scripts/test.sh, which installs JAX's "
            "CUDA plugin into .venv/h100-plugin and sets it"
        )
    if not (Path(folder) / "jax_plugins" / "xla_cuda12").is_dir():
        pytest.skip(f"JAXGA_H100_PLUGIN={folder} holds no jax_plugins/xla_cuda12")
    return Path(folder)


def test_h100_compiled_checks(tmp_path):
    """Runs tests/h100/checks.py with the plugin on the path and requires it to pass."""
    folder = plugin_folder()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))}
    path = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p)
    env.update(PYTHONPATH=path, JAX_PLATFORMS="cpu", JAXGA_H100="1", PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", str(CHECKS), "-q", "-rfEs"),
            *("-p", "no:cacheprovider", "-o", "addopts=", "--basetemp", str(tmp_path / "inner")),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    summary = result.stdout.strip().splitlines()[-1]  # stderr: the plugin's logging
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, output
