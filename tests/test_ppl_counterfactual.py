"""counterfactual: twin worlds with shared noise, against the analytic counterfactual of a
linear-Gaussian SCM, the noise-explicit model worked by hand (and NumPyro's posterior), and
the probability of necessity of a binary SCM by enumeration of its noise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest.ppl as ppl
from harvest.ppl._tfp_shim import import_tfp

tfp = import_tfp()  # a statement, so the import sorter keeps it after harvest's shim

tfd = tfp.distributions
pytestmark = [
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorflow_probability"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
Y0, X_DO = 3.0, -1.0


def linear(key):
    """x ~ N(0, 1); y = 2x + 1 + 0.5 * noise."""
    kx, ky = jax.random.split(key)
    x = ppl.random_variable(tfd.Normal(0.0, 1.0), name="x")(kx)
    return ppl.random_variable(tfd.Normal(2.0 * x + 1.0, 0.5), name="y")(ky)


def binary(key):
    """x ~ Bernoulli(0.6); P(y = 1 | x) = 0.2 + 0.7 x."""
    kx, ky = jax.random.split(key)
    x = ppl.random_variable(tfd.Bernoulli(probs=0.6, dtype=jnp.float32), name="x")(kx)
    return ppl.random_variable(tfd.Bernoulli(probs=0.2 + 0.7 * x, dtype=jnp.float32), name="y")(ky)


@pytest.fixture(scope="module")
def linear_worlds():
    pytest.importorskip("blackjax")
    return ppl.counterfactual(
        linear,
        jax.random.key(0),
        observed={"y": Y0},
        do={"x": X_DO},
        num_samples=400,
        num_warmup=300,
        num_chains=2,
    )


def _mcse(x, chains=2):
    az = pytest.importorskip("arviz")
    x = np.asarray(x).reshape(chains, -1)
    return float(x.std() / np.sqrt(az.ess(x, method="mean")))


def test_linear_gaussian_counterfactual_matches_the_analytic_one(linear_worlds):
    # x | y=Y0 is N(8 (Y0 - 1) / 17, 1/17); y's noise is (Y0 - 2x - 1) / 0.5, so
    # y under do(x=X_DO) is 2 X_DO + Y0 - 2x: N(2 X_DO + Y0 - 16 (Y0 - 1) / 17, 4/17).
    y_cf = linear_worlds.counterfactual["y"]
    mean, var = 2 * X_DO + Y0 - 16 * (Y0 - 1) / 17, 4 / 17
    assert abs(float(y_cf.mean()) - mean) < 4 * _mcse(y_cf)
    assert abs(float(y_cf.var()) - var) < 0.25 * var
    assert bool(jnp.all(linear_worlds.counterfactual["x"] == X_DO))
    assert bool(jnp.all(linear_worlds.factual["y"] == Y0))


def test_twin_worlds_equal_the_noise_explicit_model_by_hand(linear_worlds):
    x = linear_worlds.factual["x"]
    noise = (Y0 - 2.0 * x - 1.0) / 0.5  # abduction
    np.testing.assert_allclose(linear_worlds.noise["y"], noise, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(linear_worlds.noise["x"], x, rtol=1e-6)  # x = 0 + 1 * noise
    by_hand = 2.0 * X_DO + 1.0 + 0.5 * noise  # action and prediction
    np.testing.assert_allclose(linear_worlds.counterfactual["y"], by_hand, rtol=1e-5, atol=1e-5)


def test_counterfactual_mean_matches_numpyro_s_posterior_worked_by_hand(linear_worlds):
    numpyro = pytest.importorskip("numpyro")
    dist = pytest.importorskip("numpyro.distributions")

    def model():
        x = numpyro.sample("x", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(2.0 * x + 1.0, 0.5), obs=Y0)

    mcmc = numpyro.infer.MCMC(
        numpyro.infer.NUTS(model),
        num_warmup=300,
        num_samples=400,
        num_chains=2,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(5))
    x = mcmc.get_samples()["x"]
    theirs = 2.0 * X_DO + 1.0 + (Y0 - 2.0 * x - 1.0)  # 0.5 * the abduced noise
    ours = linear_worlds.counterfactual["y"]
    tolerance = 4 * np.hypot(_mcse(ours), _mcse(theirs))
    assert abs(float(ours.mean()) - float(theirs.mean())) < tolerance


def test_probability_of_necessity_matches_enumeration_of_the_noise():
    worlds = ppl.counterfactual(
        binary, jax.random.key(1), observed={"x": 1.0, "y": 1.0}, do={"x": 0.0}, num_samples=4000
    )
    estimate = float(jnp.mean(worlds.counterfactual["y"] == 0.0))
    # Enumerate the exogenous noise on a grid: each draw is 1 when its noise exceeds 1 - p.
    grid = (np.arange(2000) + 0.5) / 2000
    noise_x, noise_y = np.meshgrid(grid, grid)
    x = noise_x > 1 - 0.6
    y = noise_y > 1 - (0.2 + 0.7 * x)
    y_had_x_been_0 = noise_y > 1 - 0.2
    necessity = np.sum(x & y & ~y_had_x_been_0) / np.sum(x & y)
    np.testing.assert_allclose(necessity, (0.9 - 0.2) / 0.9, atol=1e-3)  # Tian & Pearl, monotone
    assert abs(estimate - necessity) < 4 * np.sqrt(necessity * (1 - necessity) / 4000)


def test_draws_upstream_of_the_intervention_keep_their_values():
    def model(key):
        kc, kz = jax.random.split(key)
        c = ppl.random_variable(tfd.Categorical(probs=jnp.array([0.2, 0.5, 0.3])), name="c")(kc)
        return ppl.random_variable(tfd.Normal(c.astype(jnp.float32), 1.0), name="z")(kz)

    worlds = ppl.counterfactual(
        model, jax.random.key(2), observed={"c": 1, "z": 0.3}, do={"z": 5.0}, num_samples=50
    )
    assert bool(jnp.all(worlds.counterfactual["c"] == 1))
    assert bool(jnp.all((worlds.noise["c"] > 0.2) & (worlds.noise["c"] < 0.7)))


def test_a_draw_without_a_noise_mechanism_is_named():
    def model(key):
        return ppl.random_variable(tfd.Poisson(rate=2.0), name="g")(key)

    with pytest.raises(ValueError, match="'g' has a Poisson distribution"):
        ppl.counterfactual(model, jax.random.key(0), observed={"g": 1.0}, do={"g": 2.0})
    with pytest.raises(ValueError, match="needs `do`"):
        ppl.counterfactual(linear, jax.random.key(0), observed={"y": 1.0}, do={})
