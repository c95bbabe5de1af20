"""Every docstring example in the library runs, and every public name has one."""

import doctest
import importlib
import inspect
import pkgutil

import pytest

import jaxga

MODULES = sorted(m.name for m in pkgutil.iter_modules(jaxga.__path__, "jaxga."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


@pytest.mark.parametrize("name", sorted(set(jaxga.__all__) - {"sharding"}))
def test_public_names_have_an_example(name):
    obj = getattr(jaxga, name)
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and ">>>" not in doc and obj.__init__.__doc__:
        doc += obj.__init__.__doc__
    summary = doc.strip().split("\n")[0]
    assert summary.endswith("."), f"jaxga.{name}: the docstring should open with one sentence"
    if not (inspect.isclass(obj) and issubclass(obj, tuple)):  # NamedTuple states: fields only
        assert ">>>" in doc, f"jaxga.{name} has no runnable example in its docstring"
