"""Errors raised before the work they would interrupt, naming what is wrong; chain methods."""

import inspect

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
    kx, ky = jax.random.split(key)
    x = ppl.random_variable(tfd.Normal(0.0, 1.0), name="x")(kx)
    return ppl.random_variable(tfd.Normal(x, 1.0), name="y")(ky)


def test_a_typo_in_do_is_refused_before_the_abduction(monkeypatch):
    from harvest.ppl import _counterfactual

    def never(*args, **kwargs):
        raise AssertionError("the posterior was sampled before the names were checked")

    monkeypatch.setattr(_counterfactual, "sample_posterior", never)
    with pytest.raises(KeyError, match="counterfactual: not random variables of the program: xx"):
        ppl.counterfactual(scm, jax.random.key(0), observed={"y": 1.0}, do={"xx": 2.0})


def test_counterfactual_and_sample_posterior_default_to_the_same_chains():
    chains = [
        inspect.signature(f).parameters["num_chains"].default
        for f in (ppl.counterfactual, ppl.sample_posterior)
    ]
    assert chains == [4, 4]


def test_init_redraws_until_the_density_is_finite():
    # y = 1.7 is inside Uniform(a - 0.5, a + 0.5) only for a in (1.2, 2.2): a prior draw of
    # a ~ N(0, 1) lands there about 1 time in 9, so the first draw is mostly -inf.
    def narrow(key):
        k1, k2 = jax.random.split(key)
        a = ppl.random_variable(tfd.Normal(0.0, 1.0), name="a")(k1)
        return ppl.random_variable(tfd.Uniform(a - 0.5, a + 0.5), name="y")(k2)

    density = ppl.unconstrained(narrow, {"y": 1.7})
    init = jax.jit(density.init)
    for seed in range(6):
        u = init(jax.random.key(seed))
        assert 1.2 < float(u["a"]) < 2.2
        assert np.isfinite(density.log_density(u))


def test_init_names_a_latent_it_cannot_move():
    def plain(key):
        k1, k2 = jax.random.split(key)
        z = ppl.random_variable(lambda k: jax.random.normal(k), name="z")(k1)
        return ppl.random_variable(tfd.Normal(z, 1.0), name="y")(k2)

    with pytest.raises(
        ValueError, match="'z' is drawn by a plain sampling function, which has no density"
    ):
        ppl.unconstrained(plain, {"y": 1.0}).init(jax.random.key(0))
    pytest.importorskip("blackjax")
    with pytest.raises(ValueError, match="'z' is drawn by a plain sampling function"):
        ppl.sample_posterior(plain, jax.random.key(0), observed={"y": 1.0})

    def coin(key):
        k1, k2, k3 = jax.random.split(key, 3)
        c = ppl.random_variable(tfd.Bernoulli(probs=0.3), name="c")(k1)
        m = ppl.random_variable(tfd.Normal(0.0, 1.0), name="m")(k2)
        return ppl.random_variable(tfd.Normal(m + c, 1.0), name="y")(k3)

    with pytest.raises(ValueError, match="variables c are discrete"):
        ppl.unconstrained(coin, {"y": 1.0}).init(jax.random.key(0))


def normal_mean(key):
    k1, k2 = jax.random.split(key)
    mu = ppl.random_variable(tfd.Normal(0.0, 1.0), name="mu")(k1)
    return ppl.random_variable(tfd.Sample(tfd.Normal(mu, 1.0), 3), name="y")(k2)


@pytest.mark.slow  # a compile of warmup and sampling, ~10 s on an idle machine
def test_vectorized_chains_sample_the_exact_posterior():  # the default is sequential
    pytest.importorskip("blackjax")
    y = jnp.array([1.0, 2.0, 3.0])  # exact posterior of mu: N(1.5, 1/4)
    posterior = ppl.sample_posterior(
        normal_mean,
        jax.random.key(0),
        observed={"y": y},
        num_samples=300,
        num_warmup=200,
        num_chains=2,
        chain_method="vectorized",
    )
    mu = np.asarray(posterior.samples["mu"])
    assert mu.shape == (2, 300)
    assert abs(mu.mean() - 1.5) < 0.1 and abs(mu.std() - 0.5) < 0.1
    with pytest.raises(ValueError, match="unknown chain_method 'pmap'"):
        ppl.sample_posterior(normal_mean, jax.random.key(0), observed={"y": y}, chain_method="pmap")


@pytest.mark.slow
def test_parallel_chains_without_a_device_each_run_in_turn():
    pytest.importorskip("blackjax")
    chains = jax.local_device_count() + 1
    with pytest.warns(UserWarning, match="needs a device per chain"):
        posterior = ppl.sample_posterior(
            normal_mean,
            jax.random.key(0),
            observed={"y": jnp.ones(3)},
            num_samples=5,
            num_warmup=5,
            num_chains=chains,
            chain_method="parallel",
        )
    assert posterior.samples["mu"].shape == (chains, 5)
