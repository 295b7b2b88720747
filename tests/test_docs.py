"""The documentation: every Python block in the pages runs, and the site builds with -W."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"

# Pages whose ```python blocks are executed, top to bottom, in one namespace per
# page. A block whose first line is `# not-run` (multi-device snippets, run by
# tests/multidevice instead) is skipped.
PAGES = [
    "index.md",
    "quickstart.md",
    "how_it_works.md",
    "semantics.md",
    "guides/gradients.md",
    "guides/reading_intermediates.md",
    "guides/activation_patching.md",
    "guides/many_devices.md",
    "guides/unmodified_models.md",
    "guides/probabilistic_intervention.md",
    "guides/activation_store.md",
]
# Pages that need an optional extra, skipped (with the reason) where it is not installed.
EXTRAS = {"guides/activation_store.md": ("store", ["tensorstore", "optax"])}

BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page):
    return [b for b in BLOCK.findall((DOCS / page).read_text()) if not b.startswith("# not-run")]


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, capsys):
    extra, modules = EXTRAS.get(page, ("", []))
    for module in modules:
        pytest.importorskip(module, reason=f"{page} needs the {extra} extra")
    blocks = python_blocks(page)
    assert blocks, f"{page} has no runnable python blocks"
    namespace = {"__name__": f"docs_{page}"}
    for i, block in enumerate(blocks):
        try:
            # dont_inherit: the block runs as a reader's script would, without this file's
            # `from __future__ import annotations` (which turns dataclass fields into strings).
            exec(compile(block, f"{page}[block {i}]", "exec", dont_inherit=True), namespace)
        except Exception as err:  # name the block, which pytest's traceback hides
            raise AssertionError(f"{page}, python block {i} failed:\n{block}") from err


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
    assert (tmp_path / "html" / "index.html").exists()
    assert (tmp_path / "html" / "api.html").exists()
