"""Every `>>>` example in harvest's docstrings runs and prints what it says."""

import doctest
import importlib
import io
import pkgutil

import pytest

import harvest

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
REQUIRED = [
    "harvest._sow",
    "harvest._transforms",
    "harvest._perturb",
    "harvest._capture",
    "harvest._instrument",
]


def _modules():
    names = {"harvest"}
    for info in pkgutil.walk_packages(harvest.__path__, prefix="harvest."):
        names.add(info.name)
    return sorted(names)


def _tests(module):
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(module, module.__name__) if t.examples]


@pytest.mark.parametrize("modname", _modules())
def test_module_doctests(modname):
    # Importing must work: a module that cannot be imported is a failure, not a skip.
    module = importlib.import_module(modname)
    if modname.startswith("harvest.store"):  # the examples write stores: the store extra
        pytest.importorskip("tensorstore", reason="harvest.store needs the store extra")
    tests = _tests(module)
    if modname in REQUIRED:
        assert tests, f"{modname} should have at least one >>> example in its docstrings"
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for t in tests:
        runner.run(t, out=out.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, out.getvalue()


def test_required_modules_discovered():
    mods = _modules()
    for name in REQUIRED:
        assert name in mods
