"""The package's layout as docs/how_it_works.md draws it.

Two rules a reader of the code relies on: no module is longer than a reader
can hold (about 700 lines; the message catalogue `_errors.py` and the JAX
adapter `_jax.py` are lists, read an entry at a time), and each module imports
only from its own row of the layering diagram or the rows below it.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harvest"
LONGEST = 700
LISTS = {"_errors.py", "_jax.py"}
ROWS = ("public", "layers", "calling", "the walk", "values", "base")


def modules(package=PACKAGE):
    return sorted(package.rglob("*.py"))


def unit(path, package=PACKAGE):
    """The diagram's name for the module at `path` (a subpackage is one unit)."""
    parts = path.relative_to(package).with_suffix("").parts
    if parts[0] == "compat":
        return "compat/oryx"
    return parts[0]


def diagram():
    """{unit: row}, row 0 the top, from the layering section's text block."""
    text = (ROOT / "docs" / "how_it_works.md").read_text()
    block = text.split("## 7. Layering", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    rows, row = {}, None
    for line in block.splitlines():
        for i, name in enumerate(ROWS):
            if line.startswith(name + " "):
                row, line = i, line[len(name) :]
        for token in re.findall(r"[A-Za-z_][A-Za-z_/]*", line):
            rows.setdefault(token.rstrip("/"), row)
    return rows


def imported(path, root=PACKAGE):
    """The package modules `path` imports at module level (a function's own import,
    run when it is called, is not a layer's dependency)."""
    package = path.parent.relative_to(root).parts
    for node in ast.parse(path.read_text()).body:
        if not (isinstance(node, ast.ImportFrom) and node.level):
            continue
        base = package[: len(package) - (node.level - 1)]
        names = [node.module.split(".")] if node.module else [[a.name] for a in node.names]
        for name in names:
            target = root.joinpath(*base, *name)
            for candidate in (target.with_suffix(".py"), target / "__init__.py"):
                if candidate.exists():
                    yield candidate
                    break


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_longer_than_a_reader_can_hold(path):
    if path.name in LISTS:
        return
    lines = len(path.read_text().splitlines())
    assert lines <= LONGEST, f"{path.relative_to(ROOT)} has {lines} lines: split it by concern"


def upward(package, rows):
    """The imports in `package` that go from a row up to a row above it."""
    return [
        f"{unit(p, package)} ({ROWS[rows[unit(p, package)]]}) imports "
        f"{unit(t, package)} ({ROWS[rows[unit(t, package)]]})"
        for p in modules(package)
        for t in imported(p, package)
        if rows[unit(t, package)] < rows[unit(p, package)]
    ]


def test_every_module_imports_only_from_its_row_or_below():
    rows = diagram()
    unplaced = sorted({unit(p) for p in modules()} - set(rows))
    assert not unplaced, f"modules missing from how_it_works.md's layering: {unplaced}"
    assert not upward(PACKAGE, rows)


def test_the_layering_check_sees_an_upward_import(tmp_path):
    (tmp_path / "_errors.py").write_text("from . import _patching\n")
    (tmp_path / "_patching.py").write_text("from . import _errors\n")
    assert upward(tmp_path, diagram()) == ["_errors (base) imports _patching (layers)"]
