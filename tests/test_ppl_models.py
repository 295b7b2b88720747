"""The five trial models of issue 25 (benchmarks/ppl_models.py), written in harvest.ppl,
NumPyro and TFP: the same joint density on all three, and NUTS posteriors (BlackJAX on
harvest's unconstrained density against NumPyro's NUTS, in the same process) whose means
agree within 4 Monte-Carlo standard errors on fixed seeds."""

import jax
import numpy as np
import pytest

import harvest.ppl as ppl

numpyro = pytest.importorskip("numpyro")
pytest.importorskip("funsor")  # NumPyro's enumeration of the mixture
from benchmarks import ppl_models  # noqa: E402 (needs NumPyro)

pytestmark = [
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorflow_probability"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
MODELS = list(ppl_models.BUILDERS)


@pytest.mark.parametrize("name", MODELS)
def test_harvest_numpyro_and_tfp_score_the_same_joint_density(name):
    trial = ppl_models.trial(name)
    values = {**trial.point, **trial.observed}
    ours = jax.jit(ppl.joint_log_prob(trial.harvest))(values)
    theirs = jax.jit(lambda p: ppl_models.numpyro_log_density(trial, p))(trial.point)
    tfp_side = jax.jit(trial.tfp.log_prob)(values)
    np.testing.assert_allclose(ours, theirs, rtol=2e-6)
    np.testing.assert_allclose(ours, tfp_side, rtol=2e-6)


def _mcse(x):
    """Monte-Carlo standard error of the mean of draws x [chains, draws], by ArviZ's ESS."""
    az = pytest.importorskip("arviz")
    x = np.asarray(x)
    return float(x.std() / np.sqrt(az.ess(x, method="mean")))


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_nuts_posterior_means_match_numpyro_s(name):
    pytest.importorskip("blackjax")
    trial = ppl_models.trial(name)
    # Short runs (the suite pays for every step); the tolerance grows with the MCSE.
    runs = dict(num_warmup=100, num_samples=100, num_chains=2)
    ours = ppl.sample_posterior(trial.harvest, jax.random.key(0), observed=trial.observed, **runs)
    mcmc = numpyro.infer.MCMC(
        numpyro.infer.NUTS(trial.numpyro), chain_method="vectorized", progress_bar=False, **runs
    )
    mcmc.run(jax.random.key(1))
    theirs = mcmc.get_samples(group_by_chain=True)
    for site in trial.means:
        a, b = np.asarray(ours.samples[site]), np.asarray(theirs[site])
        assert a.shape == b.shape, site
        # Element by element (a vector site, such as beta, per coordinate).
        a, b = a.reshape(2, 100, -1), b.reshape(2, 100, -1)
        for i in range(a.shape[-1]):
            tolerance = 4 * np.hypot(_mcse(a[..., i]), _mcse(b[..., i]))
            gap = abs(a[..., i].mean() - b[..., i].mean())
            assert gap < tolerance, (site, i, gap, tolerance)
