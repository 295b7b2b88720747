"""The documentation: every Python block in the pages runs and prints what the page shows,
and the site builds with -W.

A block's printed output is checked two ways: a ```text block right after a
```python block is what the whole block prints, and a `# -> ...` comment ends a
statement (or is the comment line right after it) with what that statement prints (or,
for a bare expression, its repr).
Numbers are compared with a tolerance (rtol 1e-3), `...` matches anything, and
runs of whitespace are one space. The pages show what JAX 0.10.2 prints (jaxprs
print differently on other releases), so the comparison runs on that release.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import pytest

pytestmark = (
    pytest.mark.single_release
)  # the pages show one release (PAGES_JAX); the JAX matrix skips them

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# The JAX release whose printing the pages show.
PAGES_JAX = "0.10.2"

# Pages whose ```python blocks are executed, top to bottom, in one namespace per
# page. A block whose first line is `# not-run` (multi-device snippets, run by
# tests/multidevice instead) is skipped.
PAGES = [
    "../README.md",
    "index.md",
    "quickstart.md",
    "how_it_works.md",
    "semantics.md",
    "guides/gradients.md",
    "guides/reading_intermediates.md",
    "guides/activation_patching.md",
    "guides/many_devices.md",
    "guides/unmodified_models.md",
    "guides/transformer_lens.md",
    "guides/probabilistic_intervention.md",
    "guides/activation_store.md",
]
# Pages that need an optional extra, skipped (with the reason) where it is not installed.
EXTRAS = {"guides/activation_store.md": ("store", ["tensorstore", "optax"])}

BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# A block whose first line is `# needs: <module>` runs only where that optional
# dependency is installed (the inference extra is not in the JAX matrix venvs).
NEEDS = re.compile(r"^# needs: ([\w.]+)\n")
# A python block, then (after blank lines only) the text block showing its output.
BLOCK_AND_OUTPUT = re.compile(r"^```python\n(.*?)^```\n(?:\n*```text\n(.*?)^```)?", re.S | re.M)
ARROW = re.compile(r"#\s*->\s?(.*)$")
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def python_blocks(page):
    """[(code, expected output or None)] for the page's runnable blocks."""
    found = BLOCK_AND_OUTPUT.findall((DOCS / page).read_text())
    return [(code, shown or None) for code, shown in found if not code.startswith("# not-run")]


def same_output(printed, shown):
    """Whether `printed` matches `shown`: numbers within rtol 1e-3 (atol 1e-6), `...`
    anything, whitespace runs equal."""
    pattern, numbers = [], []
    for piece in re.split(r"(\.\.\.)", " ".join(shown.split())):
        if piece == "...":
            pattern.append(".*?")
            continue
        at = 0
        for match in NUMBER.finditer(piece):
            pattern.append(re.escape(piece[at : match.start()]))
            pattern.append(f"({NUMBER.pattern})")
            numbers.append(float(match.group()))
            at = match.end()
        pattern.append(re.escape(piece[at:]))
    match = re.fullmatch("".join(pattern), " ".join(printed.split()), re.S)
    if match is None:
        return False
    return all(
        math.isclose(float(got), want, rel_tol=1e-3, abs_tol=1e-6)
        for got, want in zip(match.groups(), numbers)
    )


def shown_after(lines):
    """The `# ->` of a statement whose lines (with the comments up to the next statement)
    are `lines`: on its last line, or on a comment line of its own right after it (where
    the output would not fit on the line)."""
    last, *after = lines
    if ARROW.search(last):
        return ARROW.search(last)
    for line in after:
        if line.strip() and not line.lstrip().startswith("#"):
            return None
        if ARROW.search(line):
            return ARROW.search(line)
    return None


def run_block(code, namespace, label):
    """Runs `code` statement by statement; returns its stdout and the `# ->` checks that
    failed, as (line, shown, printed)."""
    lines = code.splitlines()
    tree = ast.parse(code)
    out, failures = io.StringIO(), []
    ends = [s.lineno - 1 for s in tree.body[1:]] + [len(lines)]
    for statement, next_start in zip(tree.body, ends):
        arrow = shown_after(lines[statement.end_lineno - 1 : next_start])
        piece = io.StringIO()
        # dont_inherit: the block runs as a reader's script would, without this file's
        # `from __future__ import annotations` (which turns dataclass fields into strings).
        is_expr = isinstance(statement, ast.Expr) and not (
            isinstance(statement.value, ast.Call)
            and getattr(statement.value.func, "id", None) == "print"
        )
        with contextlib.redirect_stdout(piece):
            if is_expr:
                expr = ast.Expression(statement.value)
                value = eval(compile(expr, label, "eval", dont_inherit=True), namespace)
                if value is not None and arrow:
                    print(repr(value))
            else:
                module = ast.Module([statement], type_ignores=[])
                exec(compile(module, label, "exec", dont_inherit=True), namespace)
        out.write(piece.getvalue())
        if arrow and not same_output(piece.getvalue(), arrow.group(1)):
            failures.append((statement.end_lineno, arrow.group(1), piece.getvalue()))
    return out.getvalue(), failures


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run_and_print_what_the_page_shows(page, capsys):
    extra, modules = EXTRAS.get(page, ("", []))
    for module in modules:
        pytest.importorskip(module, reason=f"{page} needs the {extra} extra")
    blocks = python_blocks(page)
    assert blocks, f"{page} has no runnable python blocks"
    namespace = {"__name__": f"docs_{page}"}
    stale = []
    for i, (code, shown) in enumerate(blocks):
        needs = NEEDS.match(code)
        if needs and importlib.util.find_spec(needs.group(1)) is None:
            continue
        try:
            printed, failures = run_block(code, namespace, f"{page}[block {i}]")
        except Exception as err:  # name the block, which pytest's traceback hides
            raise AssertionError(f"{page}, python block {i} failed:\n{code}") from err
        for line, want, got in failures:
            stale.append(f"block {i}, line {line}: the page shows {want!r}, it prints {got!r}")
        if shown is not None and not same_output(printed, shown):
            stale.append(f"block {i}: the page shows\n{shown}\nit prints\n{printed}")
    if stale and jax.__version__ != PAGES_JAX:
        pytest.skip(f"the pages show JAX {PAGES_JAX}'s printing; this is {jax.__version__}")
    assert not stale, f"{page} shows stale output:\n" + "\n".join(stale)


def test_output_comparison_tolerates_float_noise_and_nothing_else():
    assert same_output("[0.7615942 0.7615942]", "[0.76159 0.76159]")
    assert same_output("{'h': Array(1.5, dtype=float32)}", "{'h': ...}")
    assert not same_output("[0.5 0.7]", "[0.5 0.8]")
    assert not same_output("(3, 2)", "(3, 4)")
    assert not same_output("a b", "a")


def test_an_arrow_on_the_line_after_a_statement_is_checked():
    code = "x = 1\nprint(x + 1)\n# -> 3\nprint(x)  # -> 1\n"
    printed, failures = run_block(code, {}, "arrows")
    assert printed == "2\n1\n" and failures == [(2, "3", "2\n")]


@pytest.mark.multidevice
def test_many_devices_snippets_print_what_the_page_shows():
    # The page shows multi-device output as text; run its `# not-run` blocks on
    # eight virtual CPU devices and check that they print exactly that.
    text = (DOCS / "guides/many_devices.md").read_text()
    script = "\n".join(b for b in BLOCK.findall(text) if b.startswith("# not-run"))
    shown = re.findall(r"^```text\n(.*?)^```", text, re.S | re.M)
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Older JAX spells a PartitionSpec out in full where newer prints `P(...)`.
    printed = proc.stdout.replace("PartitionSpec(", "P(").split()
    for block in shown:
        words = block.split()
        assert any(printed[i : i + len(words)] == words for i in range(len(printed))), block


@pytest.mark.slow
def test_docs_build_with_warnings_as_errors(tmp_path):
    pytest.importorskip(
        "sphinx", reason="the docs extra (Sphinx) is not installed; `make test` builds the docs"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            str(DOCS),
            str(tmp_path / "html"),
        ],
        capture_output=True,
        text=True,
        check=False,
        env={
            **os.environ,
            "HARVEST_DOCS_NOTEBOOKS": "off",
        },  # tests/test_notebooks_*.py execute them
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    html = tmp_path / "html"
    assert (html / "index.html").exists()
    assert (html / "api.html").exists()
    # The test marker is the suite's, not the reader's: the build strips it.
    assert "# not-run" in (DOCS / "guides" / "many_devices.md").read_text()
    assert "not-run" not in (html / "guides" / "many_devices.html").read_text()
    # The reading-intermediates page shows the graph its code draws, inline.
    page = (html / "guides" / "reading_intermediates.html").read_text()
    assert 'class="harvest-view"' in page and "scan[12]" in page
    # One search box on a page (the sidebar's), not a second in the header.
    assert page.count("search-button-field") == 1
    # Parameters are described, and single backticks render as code, not <cite>.
    api = (html / "api.html").read_text()
    assert "<cite>" not in api and "exclude" in api and "Parameters" in api


# Code on every page fits the content column unwrapped: 88 columns, at the docs'
# code size (`make docs-check` checks that in a browser). A wrapped line would
# start at column 0 and read as a new statement.
WIDTH = 88
CODE_FENCES = {"", "python", "text", "sh", "bash", "console"}
ALL_PAGES = ["../README.md"] + sorted(
    str(path.relative_to(DOCS)) for path in DOCS.glob("**/*.md") if "_build" not in path.parts
)
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def code_lines(text):
    """The lines of a Markdown page's code fences (not its tables or directives)."""
    lines, fence = [], None
    for line in text.splitlines():
        opening = re.match(r"^(`{3,})(.*)$", line)
        if fence is None and opening:
            fence, info = opening.group(1), opening.group(2).strip()
        elif fence is not None and line.strip() == fence:
            fence = None
        elif fence is not None and info in CODE_FENCES:
            lines.append(line)
    return lines


@pytest.mark.parametrize("page", ALL_PAGES)
def test_code_lines_fit_in_88_columns(page):
    long = [line for line in code_lines((DOCS / page).read_text()) if len(line) > WIDTH]
    assert not long, long


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_code_fits_in_88_columns(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    code = "".join("".join(c["source"]) + "\n" for c in cells if c["cell_type"] == "code")
    long = [line for line in code.splitlines() if len(line) > WIDTH]
    assert not long, long


def test_the_code_line_reader_skips_tables_and_directives():
    page = "| a | b |\n```{eval-rst}\nskipped\n```\n```python\nx = 1\n```\n"
    assert code_lines(page) == ["x = 1"]


# `make docs-check` on two one-page sites: a table of inline code in the theme's
# scrolling box, as the oryx guide's ppl table was (its "notes" column hid behind
# the scrollbar), without and with the docs' stylesheet.
TABLE_PAGE = """<html><head><style>
article {{ width: 520px; }}
div.scroller {{ overflow-x: auto; }}
span.pre {{ white-space: nowrap; }}  /* the theme's rule for inline code */
</style>{css}</head><body><article><div class="scroller"><table><tr>
<td><code class="literal"><span class="pre">primitive.FlatPrimitive(</span></code></td>
<td><code class="literal"><span class="pre">harvest.compat.oryx.ppl.</span></code></td>
<td><code class="literal"><span class="pre">reap(tag=RANDOM_VARIABLE</span></code>
notes: the last column</td></tr></table></div></article></body></html>"""


@pytest.mark.skipif(
    shutil.which("chromium") is None and shutil.which("chromium-browser") is None,
    reason="Chromium is not installed (make chromium)",
)
@pytest.mark.parametrize("styled", [False, True], ids=["theme only", "with harvest.css"])
def test_docs_check_catches_a_clipped_table_and_the_css_fixes_it(styled, tmp_path):
    sys.path.insert(0, str(DOCS / "_static"))
    try:
        import docs_check
    finally:
        sys.path.pop(0)
    css = ""
    if styled:
        shutil.copy(DOCS / "_static" / "harvest.css", tmp_path / "harvest.css")
        css = '<link rel="stylesheet" href="harvest.css">'
    (tmp_path / "index.html").write_text(TABLE_PAGE.format(css=css))
    report = docs_check.check(tmp_path, tmp_path / "screenshots")
    if styled:
        assert report == {"index": []}
    else:
        assert len(report["index"]) == 1 and report["index"][0].startswith("table 0 is clipped")


# The README's examples, each run where only what the README names before it is
# installed: harvest and JAX (`make demo`'s venv), plus every `pip install` above
# the block. The test's venv has everything, so a child process refuses to import
# any installed distribution outside that set, as a venv without it would.
ONLY_NAMED = r"""
import importlib.metadata as metadata, json, re, sys, tomllib
from packaging.requirements import Requirement

pyproject = tomllib.load(open(sys.argv[1], "rb"))["project"]
blocks = json.load(open(sys.argv[2]))

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

def closure(requirements):
    found, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if (req.marker and not req.marker.evaluate({"extra": ""})) or norm(req.name) in found:
            continue
        found.add(norm(req.name))
        try:
            todo += [Requirement(r) for r in metadata.requires(req.name) or []]
        except metadata.PackageNotFoundError:
            pass
    return found

owners = {m: {norm(d) for d in ds} for m, ds in metadata.packages_distributions().items()}
allowed = set()

class OnlyNamed:  # a finder that finds nothing of a distribution not named
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        dists = owners.get(name.partition(".")[0])
        if dists and not dists & allowed:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):  # find_distributions, invalidate_caches: the finder's
        return getattr(self.finder, name)

sys.meta_path[:] = [OnlyNamed(finder) for finder in sys.meta_path]
namespace = {"__name__": "readme"}
for i, (installs, code) in enumerate(blocks):
    named = pyproject["dependencies"] + ["jax-harvest"]
    for install in installs:
        extras = re.fullmatch(r"-e \.\[(\w+)\]", install)
        named += pyproject["optional-dependencies"][extras.group(1)] if extras else [install]
    allowed = closure(named)
    try:
        exec(compile(code, f"README block {i}", "exec"), namespace)
    except Exception as err:
        sys.exit(f"README block {i}, after pip install {installs}: {type(err).__name__}: {err}")
"""


def readme_blocks_and_installs():
    """[(the `pip install` arguments named above the block, its code)] for the README's
    python blocks, in order."""
    text = (ROOT / "README.md").read_text()
    found, installs = [], []
    for block in re.finditer(r"^```(python|sh)\n(.*?)^```", text, re.S | re.M):
        kind, body = block.groups()
        if kind == "sh":
            for line in body.splitlines():
                command = line.partition("#")[0].strip()
                if command.startswith("pip install "):
                    installs.append(re.sub("[\"']", "", command.removeprefix("pip install ")))
        else:
            found.append((list(installs), body))
    return found


def run_with_only_named(blocks, tmp_path):
    """Runs [(installs, code)] blocks in one child process that imports only harvest, JAX
    and each block's named installs; returns the finished process."""
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    return subprocess.run(
        [
            sys.executable,
            "-c",
            ONLY_NAMED,
            str(ROOT / "pyproject.toml"),
            str(tmp_path / "blocks.json"),
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )


def test_readme_blocks_run_with_only_what_the_readme_names_before_them(tmp_path):
    pytest.importorskip("packaging", reason="reads the extras' requirements")
    pytest.importorskip("tomllib", reason="reads pyproject.toml (Python 3.11+)")
    blocks = readme_blocks_and_installs()
    assert [installs for installs, _ in blocks] == [
        [],
        ["equinox"],
        ["equinox", "-e .[patching]"],
        ["equinox", "-e .[patching]", "-e .[ppl]"],
    ]
    proc = run_with_only_named(blocks, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Without its named install, a block fails as it would in `make demo`'s venv.
    proc = run_with_only_named([([], blocks[1][1])], tmp_path)
    assert "No module named 'equinox'" in proc.stderr, proc.stderr[-3000:]
