"""benchmarks/bench_ppl.py's quick path: both sides compute the same density, and it renders."""

import jax
import numpy as np
import pytest

from benchmarks import bench_ppl

pytestmark = [
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorflow_probability"),
]


def test_both_sides_score_the_same_unconstrained_density():
    pytest.importorskip("numpyro")
    _, ours, u = bench_ppl.harvest_side()
    _, theirs, params = bench_ppl.numpyro_side()
    # The same point of R^10 (both move tau onto (0, inf) by exp): the same density and gradient.
    np.testing.assert_allclose(ours(u), theirs(params), rtol=1e-6)
    for name, grad in jax.grad(ours)(u).items():
        np.testing.assert_allclose(grad, jax.grad(theirs)(params)[name], rtol=1e-4, atol=1e-6)


def test_quick_run_renders_three_ratios():
    pytest.importorskip("numpyro")
    rows = bench_ppl.run(bench_ppl.QUICK)
    assert [r["measure"] for r in rows] == [
        "jitted gradient",
        "first compile of the gradient",
        "first eager joint log density",
    ]
    assert all(r["ratio"] > 0 for r in rows)
    assert bench_ppl.render(rows)[0] == "## harvest.ppl against NumPyro"
