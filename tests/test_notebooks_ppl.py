"""The probabilistic intervention notebook runs top to bottom, and its numbers are right.

After the notebook's own cells, one more cell (added here, not to the notebook) checks
its results in the same kernel against references computed without harvest: the
do-runs against the model's analytic answers, the conditional difference against
the confounder's effect integrated numerically, `joint_log_prob` against TFP's
densities written out, and the NUTS posterior against the exact posterior
(the model is linear-Gaussian in `beta` and `gamma` given `u` and `t`).
"""

import json
import pathlib
import sys

import pytest

NOTEBOOK = pathlib.Path(__file__).parent.parent / "notebooks" / "probabilistic_intervention.ipynb"

CHECKS = """
import numpy as np

# do(t): the same key gives every unit the same u and noise, so each unit's two
# potential outcomes differ by exactly beta.
np.testing.assert_allclose(y_do_treated - y_do_untreated, TRUE_EFFECT, atol=1e-4)
# E[y | do(t)] = beta t + gamma E[u] = beta t, with Var[y] = gamma^2 + 1: within 5 standard errors.
se = np.sqrt((TRUE_CONFOUNDING**2 + 1) / y_do_treated.shape[0])
assert abs(float(y_do_treated.mean()) - TRUE_EFFECT) < 5 * se, float(y_do_treated.mean())
assert abs(float(y_do_untreated.mean())) < 5 * se, float(y_do_untreated.mean())

# Seen: E[y | t=1] - E[y | t=0] = beta + gamma (E[u | t=1] - E[u | t=0]), where
# P(t=1 | u) = sigmoid(2u) and u ~ N(0, 1): the conditional means of u by quadrature.
u = np.linspace(-12.0, 12.0, 240_001)
density = np.exp(-u * u / 2) / np.sqrt(2 * np.pi)
p_treated = 1 / (1 + np.exp(-2 * u))
u_treated = np.trapezoid(u * density * p_treated, u) / np.trapezoid(density * p_treated, u)
u_untreated = np.trapezoid(u * density * (1 - p_treated), u) / np.trapezoid(
    density * (1 - p_treated), u
)
seen = TRUE_EFFECT + TRUE_CONFOUNDING * (u_treated - u_untreated)
sample = float(y_given_treated.mean() - y_given_untreated.mean())
assert abs(sample - seen) < 0.15, (sample, seen)  # about 5 standard errors of the sample
assert abs(float(treated.mean()) - 0.5) < 0.02  # P(t=1) = 1/2 by symmetry

# joint_log_prob at the data: TFP's densities of every variable, summed by hand.
beta, gamma = 0.3, -0.7
by_hand = (
    tfd.Normal(0.0, 2.0).log_prob(beta)
    + tfd.Normal(0.0, 2.0).log_prob(gamma)
    + tfd.Normal(0.0, 1.0).log_prob(data["u"]).sum()
    + tfd.Bernoulli(logits=2.0 * data["u"]).log_prob(data["t"]).sum()
    + tfd.Normal(beta * data["t"] + gamma * data["u"], 1.0).log_prob(data["y"]).sum()
)
np.testing.assert_allclose(target(jnp.array([beta, gamma])), by_hand, rtol=1e-5)

# The exact posterior of (beta, gamma): y ~ N(X [beta, gamma], 1) with X = [t, u] and a
# N(0, 4 I) prior (u's and t's densities do not involve them), so it is Gaussian with
# precision X'X + I/4 and mean its inverse times X'y.
X = np.stack([np.asarray(data["t"], np.float64), np.asarray(data["u"], np.float64)], axis=1)
covariance = np.linalg.inv(X.T @ X + np.eye(2) / 4)
mean = covariance @ X.T @ np.asarray(data["y"], np.float64)
sd = np.sqrt(np.diag(covariance))
np.testing.assert_allclose(posterior.mean(0), mean, atol=0.3 * sd.min())
np.testing.assert_allclose(posterior.std(0), sd, rtol=0.2)
assert 0.6 < float(acceptance) < 1.0  # NUTS's warmup aims at 0.8
assert int(fit.diverging.sum()) == 0
print("checks passed")
"""


@pytest.mark.slow
@pytest.mark.single_release  # documentation; the JAX matrix skips it
def test_probabilistic_intervention_notebook_runs_and_its_results_match_references(tmp_path):
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
    notebook.cells.append(nbformat.v4.new_code_cell(CHECKS))
    client = nbclient.NotebookClient(
        notebook, km=kernel, timeout=300, resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error (a failed check)
    errors = [
        o
        for cell in notebook.cells
        for o in cell.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors
    assert "checks passed" in "".join(o.get("text", "") for o in notebook.cells[-1].outputs)
