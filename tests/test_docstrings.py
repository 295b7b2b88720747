"""Every `>>>` example in harvest's docstrings runs and prints what it says."""

import dataclasses
import doctest
import importlib
import inspect
import io
import pkgutil
import re

import pytest

import harvest

pytestmark = pytest.mark.single_release  # the API reference's examples; the JAX matrix skips them

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
REQUIRED = [
    "harvest._walk._sow",
    "harvest._calling._transforms",
    "harvest._perturb",
    "harvest._capture",
    "harvest._models._instrument",
]

# Modules whose examples need an optional dependency that the JAX matrix venvs
# do not install (the inference extra): their examples run where it is installed.
NEEDS = {"harvest.ppl._posterior": "blackjax"}


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
    if modname in NEEDS:
        pytest.importorskip(NEEDS[modname])
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


# --- The API reference: every public parameter is described -------------------------------
#
# The reference (docs/api.md) renders each public name's Google-style docstring through
# sphinx.ext.napoleon, so a parameter missing from `Args:` is a parameter the reader never
# learns about. The check walks the public surface -- `harvest`, `harvest.ppl`,
# `harvest.compat.oryx` and its submodules, and every public (non-underscore) submodule that
# exists, so new ones such as `harvest.store` are covered the day they land -- and reads the
# real docstrings: one test per module that defines public names.

PUBLIC_ROOTS = ["harvest", "harvest.ppl", "harvest.compat.oryx", "harvest.compat.oryx.ppl"]
SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Keyword Args|Attributes):\s*$")
ENTRY = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")
RETURNS = re.compile(r"^\s*(Returns|Yields):\s*$", re.M)


def _public_modules():
    names = set(PUBLIC_ROOTS)
    for info in pkgutil.walk_packages(harvest.__path__, prefix="harvest."):
        parts = info.name.split(".")
        if not any(p.startswith("_") for p in parts) and "multidevice" not in parts:
            names.add(info.name)
    modules = []
    for name in sorted(names):
        try:
            modules.append(importlib.import_module(name))
        except ImportError as err:  # an extra that is not installed (say, TFP for harvest.ppl)
            if name == "harvest":
                raise
            print(f"skipping {name}: {err}")
    return modules


def _exported(module):
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    for name in names:
        obj = getattr(module, name)
        home = getattr(obj, "__module__", "") or ""
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and home.startswith("harvest"):
            yield obj


def public_objects():
    """{defining module: [public functions and classes]}, each object once."""
    seen, by_module = set(), {}
    for module in _public_modules():
        for obj in _exported(module):
            if id(obj) not in seen:
                seen.add(id(obj))
                by_module.setdefault(obj.__module__, []).append(obj)
    return by_module


def described(doc):
    """The names a Google-style docstring's Args/Attributes sections describe (with text)."""
    names, lines = set(), inspect.cleandoc(doc or "").splitlines()
    for i, line in enumerate(lines):
        header = SECTION.match(line)
        if not header:
            continue
        indent = len(header.group(1))
        entry_indent = None
        for j in range(i + 1, len(lines)):
            text = lines[j]
            if not text.strip():
                continue
            depth = len(text) - len(text.lstrip())
            if depth <= indent:
                break
            entry_indent = depth if entry_indent is None else entry_indent
            match = ENTRY.match(text) if depth == entry_indent else None
            if match:
                following = lines[j + 1] if j + 1 < len(lines) else ""
                continued = following.strip() and len(following) - len(following.lstrip()) > depth
                if match.group(3).strip() or continued:
                    names.add(match.group(1).lstrip("*"))
    return names


def _parameters(fn, skip_first=False):
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    if skip_first and params:
        params = params[1:]
    return [p.name for p in params]


def _returns_something(fn):
    annotation = inspect.signature(fn).return_annotation
    return annotation not in (None, "None", type(None))


def problems(obj):
    """What `obj`'s reference entry leaves out: parameters without a description, or a
    function that returns something without a Returns: section."""
    missing = []
    qual = f"{obj.__module__}.{obj.__qualname__}"
    if inspect.isfunction(obj):
        doc = obj.__doc__ or ""
        undescribed = [p for p in _parameters(obj) if p not in described(doc)]
        if undescribed:
            missing.append(f"{qual}: no description for {undescribed}")
        if _returns_something(obj) and not RETURNS.search(inspect.cleandoc(doc)):
            missing.append(f"{qual}: no Returns: section")
        return missing
    # A class: its constructor's parameters (or a dataclass's fields) in the class docstring
    # or __init__'s, and every public method defined on it.
    doc = (
        (obj.__doc__ or "")
        + "\n"
        + (vars(obj).get("__init__").__doc__ or "" if "__init__" in vars(obj) else "")
    )
    if dataclasses.is_dataclass(obj):
        wanted = [f.name for f in dataclasses.fields(obj)]
    elif "__init__" in vars(obj):
        wanted = _parameters(obj.__init__, skip_first=True)
    else:
        wanted = []
    undescribed = [p for p in wanted if p not in described(doc)]
    if undescribed:
        missing.append(f"{qual}: no description for {undescribed}")
    for name, member in vars(obj).items():
        if name.startswith("_"):
            continue
        fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if inspect.isfunction(fn):
            skip = not isinstance(member, staticmethod)
            params = _parameters(fn, skip_first=skip)
            undescribed = [p for p in params if p not in described(fn.__doc__)]
            if undescribed:
                missing.append(f"{qual}.{name}: no description for {undescribed}")
            if _returns_something(fn) and not RETURNS.search(inspect.cleandoc(fn.__doc__ or "")):
                missing.append(f"{qual}.{name}: no Returns: section")
    return missing


def _reference_cases():
    return [pytest.param(m, objs, id=m) for m, objs in sorted(public_objects().items())]


@pytest.mark.parametrize(("module", "objs"), _reference_cases())
def test_every_public_parameter_is_described(module, objs):
    missing = [m for obj in objs for m in problems(obj)]
    assert not missing, "\n".join(missing)


def test_the_parser_reads_google_style_sections():
    doc = """Summary.

    Args:
        x: the input.
        y (int): a count,
            over two lines.
        empty:
        *args: more inputs.

    Returns:
        Something.
    """
    assert described(doc) == {"x", "y", "args"}
    assert described("Summary.\n\nExample:\n    >>> f(x=1)\n") == set()
