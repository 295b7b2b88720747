"""Runs notebooks/activation_patching.ipynb top to bottom; any error fails the test."""

import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "activation_patching.ipynb"


@pytest.mark.slow
@pytest.mark.single_release  # documentation; the JAX matrix skips it
def test_activation_patching_notebook_runs(monkeypatch):
    # The kernel imports this checkout's harvest, not whichever copy the venv has installed.
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join(filter(None, [str(NOTEBOOK.parents[1]), os.environ.get("PYTHONPATH")])),
    )
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("all checks passed" in o.get("text", "") for o in outputs)
