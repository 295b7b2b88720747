"""predictive: prior and posterior predictive draws against the program threaded by hand."""

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
]


def scm(key):
    kz, ks, kt, ky = jax.random.split(key, 4)
    z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(kz)
    s = ppl.random_variable(tfd.HalfNormal(1.0), name="s")(ks)
    t = ppl.random_variable(tfd.Bernoulli(logits=2.0 * z, dtype=jnp.float32), name="t")(kt)
    mean = ppl.deterministic(z + 2.0 * t, name="mean")
    return ppl.random_variable(tfd.Sample(tfd.Normal(mean, s), 3), name="y")(ky)


def scm_by_hand(key, z=None, s=None, t=None):
    """The same program without harvest; given values replace the draws."""
    kz, ks, kt, ky = jax.random.split(key, 4)
    z = tfd.Normal(0.0, 1.0).sample(seed=kz) if z is None else z
    s = tfd.HalfNormal(1.0).sample(seed=ks) if s is None else s
    t = tfd.Bernoulli(logits=2.0 * z, dtype=jnp.float32).sample(seed=kt) if t is None else t
    y = tfd.Sample(tfd.Normal(z + 2.0 * t, s), 3).sample(seed=ky)
    return {"z": z, "s": s, "t": t, "mean": z + 2.0 * t, "y": y}


def fake_posterior(chains=2, draws=5):
    """A Posterior of known draws: predictive does not care where they came from."""
    key_z, key_s = jax.random.split(jax.random.key(7))
    z = jax.random.normal(key_z, (chains, draws))
    s = jnp.exp(0.1 * jax.random.normal(key_s, (chains, draws)))
    zeros = jnp.zeros((chains, draws))
    return ppl.Posterior(
        samples={"z": z, "s": s, "mean": z + 2.0},
        log_density=zeros,
        unconstrained={"z": z, "s": jnp.log(jnp.expm1(s))},
        diverging=zeros.astype(bool),
        acceptance_rate=zeros,
        step_size=jnp.ones(chains),
    )


def test_prior_predictive_is_the_program_run_on_split_keys():
    key = jax.random.key(0)
    prior = ppl.predictive(scm, key, num_samples=6)
    expected = jax.vmap(scm_by_hand)(jax.random.split(key, 6))
    assert sorted(prior) == ["mean", "s", "t", "y", "z"]
    for name in expected:
        np.testing.assert_allclose(prior[name], expected[name], rtol=1e-5, atol=1e-6)


def test_posterior_predictive_plants_each_draw_and_predicts_the_rest():
    # The posterior of scm under do(t=1): predicting under the same do() keeps t at 1.
    posterior = fake_posterior()
    key = jax.random.key(1)
    do_t = ppl.intervene(scm, t=jnp.float32(1.0))
    predicted = ppl.predictive(do_t, key, posterior=posterior)
    keys = jax.random.split(key, 10).reshape(2, 5)
    expected = jax.vmap(jax.vmap(lambda k, z, s: scm_by_hand(k, z, s, t=1.0)))(
        keys, posterior.samples["z"], posterior.samples["s"]
    )
    assert sorted(predicted) == ["mean", "s", "y", "z"]
    for name in ("z", "s", "mean", "y"):
        assert predicted[name].shape[:2] == (2, 5)
        np.testing.assert_allclose(predicted[name], expected[name], rtol=1e-5, atol=1e-6)


def test_posterior_predictive_under_another_intervention():
    # Learnt under do(t=1), predicted under do(t=0): the mean drops by 2 for every draw.
    posterior = fake_posterior()
    key = jax.random.key(2)
    predicted = ppl.predictive(ppl.intervene(scm, t=jnp.float32(0.0)), key, posterior=posterior)
    np.testing.assert_allclose(predicted["mean"], posterior.samples["z"], rtol=1e-6)
    # An intervention on a latent wins over the posterior's value of it.
    fixed_z = ppl.predictive(ppl.intervene(scm, z=jnp.float32(0.5)), key, posterior=posterior)
    assert "z" not in fixed_z
    assert bool(jnp.all((fixed_z["t"] == 1.0) == (fixed_z["mean"] == 2.5)))


def test_prior_predictive_needs_a_count():
    with pytest.raises(ValueError, match="positive int"):
        ppl.predictive(scm, jax.random.key(0))
