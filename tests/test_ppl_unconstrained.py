"""unconstrained: densities over R^n for HMC/NUTS, checked against TFP and a recorded posterior."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest.ppl as ppl
from benchmarks import ppl_models
from harvest.ppl._tfp_shim import import_tfp

tfp = import_tfp()  # a statement, so the import sorter keeps it after harvest's shim

tfd = tfp.distributions
pytestmark = [
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorflow_probability"),
]
GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden" / "eight_schools.json").read_text())
Y = jnp.asarray(ppl_models.SCHOOLS_Y)
eight_schools = ppl_models.eight_schools()  # the trial's model (benchmarks/ppl_models.py)


def test_density_is_the_model_s_through_each_default_bijector():
    posterior = ppl.unconstrained(eight_schools, observed={"y": Y})
    u = {"mu": jnp.array(1.0), "tau": jnp.array(-0.5), "theta_tilde": jnp.linspace(-1.0, 1.0, 8)}
    to_tau = tfd.HalfCauchy(0.0, 5.0).experimental_default_event_space_bijector()
    tau = to_tau.forward(u["tau"])
    values = {"mu": u["mu"], "tau": tau, "theta_tilde": u["theta_tilde"], "y": Y}
    expected = ppl.joint_log_prob(eight_schools)(values) + to_tau.forward_log_det_jacobian(u["tau"])
    np.testing.assert_allclose(posterior.log_density(u), expected, rtol=1e-5)
    back = posterior.constrain(u)
    assert sorted(back) == ["mu", "tau", "theta", "theta_tilde"]  # deterministic sites too
    np.testing.assert_allclose(back["tau"], tau, rtol=1e-6)
    np.testing.assert_allclose(back["theta"], u["mu"] + tau * u["theta_tilde"], rtol=1e-5)
    start = posterior.init(jax.random.key(0))
    assert jax.tree_util.tree_map(jnp.shape, start) == {"mu": (), "tau": (), "theta_tilde": (8,)}
    # The model's own transformations are not affected by the unconstrained traces.
    assert sorted(ppl.joint_sample(eight_schools)(jax.random.key(0))) == [
        "mu",
        "tau",
        "theta_tilde",
        "y",
    ]


def test_hmc_on_the_unconstrained_density_recovers_the_recorded_posterior_mean():
    posterior = ppl.unconstrained(eight_schools, observed={"y": Y})
    chains = 8

    def target(mu, tau, theta_tilde):
        u = {"mu": mu, "tau": tau, "theta_tilde": theta_tilde}
        return jax.vmap(posterior.log_density)(u)

    kernel = tfp.mcmc.DualAveragingStepSizeAdaptation(
        tfp.mcmc.HamiltonianMonteCarlo(target, step_size=0.3, num_leapfrog_steps=8),
        num_adaptation_steps=400,
    )
    start = jax.vmap(posterior.init)(jax.random.split(jax.random.key(1), chains))
    init = [start["mu"], start["tau"], start["theta_tilde"]]
    run = jax.jit(
        lambda key: tfp.mcmc.sample_chain(
            1000, init, kernel=kernel, num_burnin_steps=500, trace_fn=None, seed=key
        )
    )
    draws = run(jax.random.key(2))
    mu = jax.vmap(
        jax.vmap(lambda *u: posterior.constrain(dict(zip(["mu", "tau", "theta_tilde"], u))))
    )(*draws)["mu"]
    ess = tfp.mcmc.effective_sample_size(mu, cross_chain_dims=1)
    standard_error = float(jnp.sqrt(mu.var() / ess + GOLDEN["mc_se"] ** 2))
    assert abs(float(mu.mean()) - GOLDEN["mu_mean"]) < 4 * standard_error, (
        float(mu.mean()),
        standard_error,
    )


def test_discrete_variables_must_be_observed():
    def coin(key):
        return ppl.random_variable(tfd.Bernoulli(probs=0.3), name="flip")(key)

    with pytest.raises(ValueError, match="flip are discrete"):
        ppl.unconstrained(coin).log_density({"flip": jnp.array(0.0)})
    observed = ppl.unconstrained(coin, observed={"flip": jnp.array(1, jnp.int32)})
    np.testing.assert_allclose(
        observed.log_density({}), tfd.Bernoulli(probs=0.3).log_prob(1), rtol=1e-6
    )


@jax.jit
def _draw_scale(key):
    return ppl.random_variable(tfd.HalfNormal(1.0), name="scale")(key)


def _scale_model(key):
    k1, k2 = jax.random.split(key)
    return ppl.random_variable(tfd.Normal(0.0, _draw_scale(k1)), name="y")(k2)


def test_a_jitted_helper_traced_by_unconstrained_does_not_leak_into_joint_log_prob():
    # The switch is part of jit's cache key: the helper is traced once with it, once without.
    u = {"scale": jnp.log(jnp.expm1(0.8))}
    to_scale = tfd.HalfNormal(1.0).experimental_default_event_space_bijector()
    prior = tfd.HalfNormal(1.0).log_prob(0.8) + tfd.Normal(0.0, 0.8).log_prob(0.3)
    first = ppl.unconstrained(_scale_model, observed={"y": 0.3}).log_density(u)
    np.testing.assert_allclose(
        first, prior + to_scale.forward_log_det_jacobian(u["scale"]), rtol=1e-5
    )
    np.testing.assert_allclose(
        ppl.joint_log_prob(_scale_model)({"scale": 0.8, "y": 0.3}), prior, rtol=1e-6
    )


def test_joint_log_prob_first_then_unconstrained_through_a_jitted_helper():
    # A helper of its own, so this test sees the other order whatever ran before.
    draw = jax.jit(lambda k: ppl.random_variable(tfd.HalfNormal(1.0), name="scale")(k))

    def model(key):
        k1, k2 = jax.random.split(key)
        return ppl.random_variable(tfd.Normal(0.0, draw(k1)), name="y")(k2)

    values = {"scale": 0.8, "y": 0.3}
    prior = tfd.HalfNormal(1.0).log_prob(0.8) + tfd.Normal(0.0, 0.8).log_prob(0.3)
    np.testing.assert_allclose(ppl.joint_log_prob(model)(values), prior, rtol=1e-6)
    u = {"scale": jnp.log(jnp.expm1(0.8))}
    to_scale = tfd.HalfNormal(1.0).experimental_default_event_space_bijector()
    np.testing.assert_allclose(
        ppl.unconstrained(model, observed={"y": 0.3}).log_density(u),
        prior + to_scale.forward_log_det_jacobian(u["scale"]),
        rtol=1e-5,
    )


def dirichlet_multinomial(key):
    kp, ky = jax.random.split(key)
    p = ppl.random_variable(tfd.Dirichlet(jnp.array([1.0, 2.0, 3.0])), name="p")(kp)
    return ppl.random_variable(tfd.Multinomial(10.0, probs=p), name="y")(ky)


def test_a_dirichlet_draw_moves_on_the_simplex_through_softmax_centered():
    # TFP 0.25's SoftmaxCentered calls np.reshape(newshape=...), gone in NumPy 2.4:
    # harvest's TFP shim keeps it working.
    counts = jnp.array([2.0, 3.0, 5.0])
    posterior = ppl.unconstrained(dirichlet_multinomial, observed={"y": counts})
    u = {"p": jnp.array([0.3, -0.4])}
    to_p = tfd.Dirichlet(jnp.ones(3)).experimental_default_event_space_bijector()
    p = to_p.forward(u["p"])
    np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-6)
    expected = (
        tfd.Dirichlet(jnp.array([1.0, 2.0, 3.0])).log_prob(p)
        + to_p.forward_log_det_jacobian(u["p"])
        + tfd.Multinomial(10.0, probs=p).log_prob(counts)
    )
    np.testing.assert_allclose(posterior.log_density(u), expected, rtol=1e-5)
    np.testing.assert_allclose(posterior.constrain(u)["p"], p, rtol=1e-6)
    assert posterior.init(jax.random.key(0))["p"].shape == (2,)


def normal_mean(key):
    k1, k2 = jax.random.split(key)
    mu = ppl.random_variable(tfd.Normal(0.0, 1.0), name="mu")(k1)
    return ppl.random_variable(tfd.Sample(tfd.Normal(mu, 1.0), 3), name="y")(k2)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_observation_is_refused_naming_the_site(bad):
    # NumPyro refuses such data at init; a sampler on it would stay at its start.
    y = jnp.array([1.0, bad, 3.0])
    with pytest.raises(ValueError, match=r"observed value of 'y' has 1 non-finite .* index \(1,\)"):
        ppl.unconstrained(normal_mean, observed={"y": y})
    pytest.importorskip("blackjax")  # sample_posterior's sampler (the `infer` extra)
    with pytest.raises(ValueError, match="observed value of 'y'"):
        ppl.sample_posterior(normal_mean, jax.random.key(0), observed={"y": y})
    scoped = ppl.nest(normal_mean, scope="s")
    with pytest.raises(ValueError, match="observed value of 's.y'"):
        ppl.unconstrained(scoped, observed={"s": {"y": y}})


def test_a_start_with_a_non_finite_density_is_refused_naming_the_site():
    def beta_model(key):
        k1, k2 = jax.random.split(key)
        a = ppl.random_variable(tfd.HalfNormal(1.0), name="a")(k1)
        return ppl.random_variable(tfd.Beta(a, 2.0), name="y")(k2)

    # y = 1.5 lies outside the Beta's support: its log density is NaN at every start.
    assert np.isnan(tfd.Beta(1.0, 2.0).log_prob(1.5))
    pytest.importorskip("blackjax")  # sample_posterior's sampler (the `infer` extra)
    with pytest.raises(ValueError, match=r"'y' has 1 element\(s\) of 1 outside the support"):
        ppl.sample_posterior(beta_model, jax.random.key(0), observed={"y": 1.5})

    def nan_weight(key):  # a density that is NaN at every start, with data in the support
        a = beta_model(key)
        ppl.factor(jnp.log(-jnp.abs(a) - 1.0), name="w")
        return a

    with pytest.raises(ValueError, match=r"log density of chain 0 is not finite.*'w': nan"):
        ppl.sample_posterior(nan_weight, jax.random.key(0), observed={"y": 0.5})
