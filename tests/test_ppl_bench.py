"""benchmarks/bench_ppl.py: both sides time the same density (its quick run is in test_benchmarks.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import bench_ppl

pytestmark = [
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorflow_probability"),
]


def test_both_sides_score_the_same_unconstrained_density():
    pytest.importorskip("numpyro")
    from benchmarks import ppl_models

    trial = ppl_models.trial("eight schools")
    ours, (theirs, _) = bench_ppl.harvest_side(trial), bench_ppl.numpyro_side(trial)
    # The same point of R^10 (both move tau onto (0, inf) by exp): the same density and gradient.
    u = {"mu": jnp.array(1.0), "tau": jnp.array(0.5), "theta_tilde": jnp.zeros(8)}
    np.testing.assert_allclose(ours(u), theirs(u), rtol=1e-6)
    for name, grad in jax.grad(ours)(u).items():
        np.testing.assert_allclose(grad, jax.grad(theirs)(u)[name], rtol=1e-4, atol=1e-6)
