"""Sphinx configuration for harvest's documentation (`make docs`).

Pages are Markdown read by MyST, and notebooks render through myst-nb: the
same stack JAX, Flax and oryx use, so a reader moving between those sites and
this one meets the same syntax, and the guides stay plain Markdown that the
tests can execute block by block. Warnings are errors (`-W`) in `make docs`.
"""

import contextlib
import io
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # document the working tree, not an installed copy

import harvest  # noqa: E402

project = "harvest"
author = "the harvest authors"
copyright = "the harvest authors"
release = version = harvest.__version__

extensions = [
    "myst_nb",  # Markdown (MyST) pages and .ipynb notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style Args:/Returns:/Raises:/Example: sections
]

# `single backticks` in a docstring or page render as code, as they do on
# GitHub, not as italic <cite> (reStructuredText's default role).
default_role = "code"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False  # the return type joins the Returns: text
napoleon_use_ivar = True  # a dataclass's Attributes: become :ivar: fields

# `notebooks` links to the repository's notebooks/ folder. They are committed
# without outputs, so the build executes them (top to bottom, in a fresh kernel)
# and renders what they print and plot; an error in a cell fails the build.
# HARVEST_DOCS_NOTEBOOKS=off renders them unexecuted -- the docs test does that,
# because tests/test_notebooks_*.py execute them already.
nb_execution_mode = os.environ.get("HARVEST_DOCS_NOTEBOOKS", "force")
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
)  # kernels import this tree
nb_execution_timeout = (
    300  # seconds per cell; training cells on a shared 2-core machine
)
nb_execution_raise_on_error = True
nb_execution_show_tb = True  # the failing cell's traceback in the build log
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

exclude_patterns = [
    "_build",
    "_generated",
    "**.ipynb_checkpoints",
    "Thumbs.db",
    ".DS_Store",
]
suppress_warnings = [
    "toc.empty_glob",  # before any notebook exists, the notebooks glob matches nothing
    "myst-nb.lexer",  # a notebook saved without kernel metadata renders unhighlighted, not as an error
]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False}

html_theme = "sphinx_book_theme"
html_title = "harvest"
# One search box, the sidebar's: the header's persistent one would be a second.
html_theme_options = {"show_toc_level": 2, "navbar_persistent": []}

# Code and tables that fit the column, at 88 columns of code (see _static/harvest.css).
html_static_path = ["_static"]
html_css_files = ["harvest.css"]

# `# not-run` opens the blocks the test suite runs elsewhere (on eight virtual
# devices, tests/multidevice), `# needs: <module>` those it runs only where an
# optional dependency is installed: markers for the tests, not for readers (the
# whole line goes, with any note after the marker).
NOT_RUN = re.compile(r"^(```python\n)# (?:not-run|needs: [\w.]+)\b[^\n]*\n", re.M)
# Pages that show what a block of theirs draws: the page, the block that draws,
# and the file (under _generated/, which git ignores) the page includes.
DRAWN = {
    "guides/reading_intermediates.md": ("view(", "view_reading_intermediates.html")
}


def _hide_test_markers(app, docname, source):
    source[0] = NOT_RUN.sub(r"\1", source[0])


def _draw_views(app):
    """Runs each page of DRAWN up to its drawing block and writes the HTML it draws."""
    out = pathlib.Path(app.srcdir) / "_generated"
    out.mkdir(exist_ok=True)
    for page, (marker, target) in DRAWN.items():
        namespace = {"__name__": f"docs_{page}"}
        text = (pathlib.Path(app.srcdir) / page).read_text()
        for block in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M):
            with contextlib.redirect_stdout(
                io.StringIO()
            ):  # what the page prints, not the log
                exec(compile(block, page, "exec"), namespace)
            if marker in block:
                break
        (out / target).write_text(namespace["graph"].html, encoding="utf-8")


def setup(app):
    app.connect("source-read", _hide_test_markers)
    app.connect("builder-inited", _draw_views)
