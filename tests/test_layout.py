"""The package's layout, as its folders' READMEs state it.

A file listing shows the architecture: each layer is a folder whose README says
which layers it may import (`May import: ...`, lower ones only), and at most six
private modules sit directly in `harvest/` beside the fixed ones. The import graph
has no circle, and no module is longer than a reader can hold (about 700 lines;
the JAX adapter `_jax.py` is a list, read an entry at a time).
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harvest"
LONGEST = 700
LISTS = {"_jax.py"}
FIXED = {"__init__", "__main__", "config", "extend", "_version", "_typing"}
MOST_AT_THE_TOP = 6


def modules(package=PACKAGE):
    return sorted(package.rglob("*.py"))


def unit(path, package=PACKAGE):
    """The layer `path` belongs to: its top folder, or itself for a top-level module."""
    parts = path.relative_to(package).with_suffix("").parts
    return parts[0]


def base(package=PACKAGE):
    """The base modules, from the package README's `Base:` line."""
    text = (package / "README.md").read_text()
    return set(re.findall(r"`(\w+)`", re.search(r"^Base: (.*)$", text, re.M).group(1)))


def allowed(package=PACKAGE):
    """{layer: the layers it may import}: each folder's README's `May import:` line;
    base modules import only base; the other top-level modules, anything."""
    floor = base(package)
    rules = {name: floor for name in floor}
    for readme in sorted(package.glob("*/README.md")):
        if not (readme.parent / "__init__.py").exists():
            continue
        line = re.search(r"^May import: (.*)$", readme.read_text(), re.M)
        assert line, f"{readme.relative_to(ROOT)} says nothing of what it may import"
        names = set(re.findall(r"`(\w+)`", line.group(1)))
        rules[readme.parent.name] = names | (floor if "base" in line.group(1) else set())
    return rules


def imported(path, root=PACKAGE):
    """The package modules `path` imports, at module level or inside a function (not
    those under `if TYPE_CHECKING:`, which never run)."""
    package = path.parent.relative_to(root).parts
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            node.body = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level):
            continue
        start = package[: len(package) - (node.level - 1)]
        module = node.module.split(".") if node.module else []
        for alias in node.names if not module else [None, *node.names]:
            target = root.joinpath(*start, *module, *([alias.name] if alias else []))
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


def test_a_file_listing_shows_the_layers():
    top = {p.stem for p in PACKAGE.glob("*.py")} - FIXED
    assert len(top) <= MOST_AT_THE_TOP, f"move some of {sorted(top)} into their layer's folder"
    for folder in PACKAGE.iterdir():
        if (folder / "__init__.py").exists():
            assert (folder / "README.md").exists(), f"{folder.name}/ has no README"


def wrong_way(package, rules):
    """The imports that go from a layer to one it may not import."""
    return sorted(
        {
            f"{unit(p, package)} imports {unit(t, package)}"
            for p in modules(package)
            for t in imported(p, package)
            if unit(p, package) in rules
            and unit(t, package) != unit(p, package)
            and unit(t, package) not in rules[unit(p, package)]
        }
    )


def test_every_layer_imports_only_what_its_readme_allows():
    assert not wrong_way(PACKAGE, allowed())


def test_the_layering_check_sees_a_wrong_way_import(tmp_path):
    (tmp_path / "README.md").write_text("Base: `_errors`.\n")
    (tmp_path / "_errors.py").write_text("from ._walk import _site\n")
    (tmp_path / "_walk").mkdir()
    (tmp_path / "_walk" / "__init__.py").write_text("")
    (tmp_path / "_walk" / "README.md").write_text("May import: base.\n")
    (tmp_path / "_walk" / "_site.py").write_text("from .. import _errors\n")
    assert wrong_way(tmp_path, allowed(tmp_path)) == ["_errors imports _walk"]


def circles(package):
    """The import circles among the package's modules (strongly connected sets)."""
    graph = {p: set(imported(p, package)) for p in modules(package)}
    index, low, stack, found, count = {}, {}, [], [], [0]

    def visit(v):
        index[v] = low[v] = count[0]
        count[0] += 1
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(str(p.relative_to(package)) for p in part))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circle():
    assert circles(PACKAGE) == []


def test_the_circle_check_sees_a_circle(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from . import b\n")
    (tmp_path / "b.py").write_text("from . import a\n")
    assert circles(tmp_path) == [["a.py", "b.py"]]
