"""The documentation runs: every docstring example, and every Python block of the pages.

Each page (``README.md``, ``docs/**/*.md``) runs as one script, its ```python blocks in
order in one namespace, in a fresh process on the CPU, from a scratch directory with the
repository on the path. A block runs unless the line before its fence is
``<!-- skip: REASON -->``, kept for blocks that need a GPU or many hosts.
"""

import doctest
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jaxga

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(m.name for m in pkgutil.iter_modules(jaxga.__path__, "jaxga."))
PAGES = sorted(
    p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *ROOT.glob("docs/**/*.md")]
)
DEVICES = {
    "docs/distributed.md": 4,
    "docs/pipeline.md": 4,
    "docs/planner.md": 8,
}  # CPU devices of a page (default 1)
FENCE = re.compile(r"^```(\w*)\s*$")
SKIP = re.compile(r"^<!-- skip: (.+) -->$")


def python_blocks(page):
    """Yields ``(line, code, skip_reason)`` for each ```python block of ``page``."""
    lines = (ROOT / page).read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence and fence.group(1):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if fence.group(1) == "python":
                skip = SKIP.match(lines[i - 1]) if i else None
                yield i + 2, "\n".join(lines[i + 1 : end]), skip and skip.group(1)
            i = end
        i += 1


RUN_PAGE = """
for line, code in BLOCKS:  # padded so that tracebacks give the page's own line numbers
    exec(compile("\\n" * (line - 1) + code, PAGE, "exec"), globals())
"""


@pytest.mark.parametrize("page", PAGES)
def test_page_code_blocks_run(page, tmp_path):
    blocks = [(line, code) for line, code, skip in python_blocks(page) if not skip]
    if not blocks:
        pytest.skip(f"{page} has no Python block")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    devices = f"--xla_force_host_platform_device_count={DEVICES.get(page, 1)}"
    env["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {devices}"  # conftest's, and the devices
    program = f"PAGE = {str(ROOT / page)!r}\nBLOCKS = {blocks!r}\n{RUN_PAGE}"
    run = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, f"a code block of {page} failed:\n{run.stderr[-4000:]}"


@pytest.mark.parametrize("page", PAGES)
def test_skipped_blocks_say_why(page):
    for line, _, skip in python_blocks(page):
        if skip:
            assert re.search(r"GPU|hosts|processes", skip), (
                f"{page}:{line} is skipped ({skip!r}); only blocks that need a GPU or many "
                "hosts may be"
            )


def test_readme_is_one_screen():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 160, f"README.md has {lines} lines; it should have at most 160"


def test_api_reference_lists_every_public_name():
    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: jaxga\.(\w+)", api, re.MULTILINE))
    missing = set(jaxga.__all__) - documented
    assert not missing, f"docs/api.md has no `::: jaxga.NAME` entry for {sorted(missing)}"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


@pytest.mark.parametrize("name", sorted(set(jaxga.__all__) - {"sharding", "collectives"}))
def test_public_names_have_an_example(name):
    obj = getattr(jaxga, name)
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and ">>>" not in doc and obj.__init__.__doc__:
        doc += obj.__init__.__doc__
    summary = doc.strip().split("\n")[0]
    assert summary.endswith("."), f"jaxga.{name}: the docstring should open with one sentence"
    if not (inspect.isclass(obj) and issubclass(obj, tuple)):  # NamedTuple states: fields only
        assert ">>>" in doc, f"jaxga.{name} has no runnable example in its docstring"
