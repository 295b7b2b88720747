"""The probabilistic intervention notebook runs top to bottom."""

import json
import pathlib
import sys

import pytest

NOTEBOOK = pathlib.Path(__file__).parent.parent / "notebooks" / "probabilistic_intervention.ipynb"


@pytest.mark.slow
@pytest.mark.single_release  # documentation; the JAX matrix skips it
def test_probabilistic_intervention_notebook_runs(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    # Run on this interpreter (the venv), whatever kernels the machine has.
    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "harvest venv",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    kernel = KernelManager(kernel_name="python3", kernel_spec_manager=specs)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook, km=kernel, timeout=300, resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    errors = [
        o
        for cell in notebook.cells
        for o in cell.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors
