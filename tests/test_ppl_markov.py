"""Draws enumerated at each step of a scan, summed out by a forward pass: against the
forward algorithm written by hand in NumPy, and NumPyro's `markov` enumeration."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import norm

import harvest.ppl as ppl
from harvest.ppl._tfp_shim import import_tfp

tfp = import_tfp()  # a statement, so the import sorter keeps it after harvest's shim

tfd = tfp.distributions
pytestmark = [
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorflow_probability"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def hmm_of(init, trans, locs):
    """An HMM: z[t] ~ Categorical(trans[z[t-1]]) (init at t = 0), y[t] ~ N(locs[z[t]] + mu, 1)."""
    init, trans, locs = (jnp.asarray(a, jnp.float32) for a in (init, trans, locs))

    def hmm(key, length):
        mu = ppl.random_variable(tfd.Normal(0.0, 1.0), name="mu")(key)

        def step(prev, k):
            k1, k2 = jax.random.split(k)
            probs = jnp.where(prev < 0, init, trans[jnp.maximum(prev, 0)])
            z = ppl.random_variable(
                tfd.Categorical(probs=probs), name="z", mode="append", enumerate=True
            )(k1)
            y = ppl.random_variable(tfd.Normal(locs[z] + mu, 1.0), name="y", mode="append")(k2)
            return z, y

        return jax.lax.scan(step, -1, jax.random.split(key, length))[1]

    return hmm


def forward_by_hand(init, trans, locs, mu, y):
    """log p(mu, y) by the forward algorithm, in float64 NumPy."""
    emit = norm.logpdf(np.asarray(y, float)[:, None], np.asarray(locs)[None] + mu, 1.0)
    alpha = np.log(init) + emit[0]
    for t in range(1, len(y)):
        alpha = np.logaddexp.reduce(alpha[:, None] + np.log(trans), axis=0) + emit[t]
    return np.logaddexp.reduce(alpha) + norm.logpdf(mu)


TWO = (np.array([0.6, 0.4]), np.array([[0.9, 0.1], [0.2, 0.8]]), np.array([-1.0, 1.5]))
THREE = (
    np.array([0.5, 0.3, 0.2]),
    np.array([[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.25, 0.25, 0.5]]),
    np.array([-2.0, 0.0, 2.5]),
)


def data(locs, length, seed=0):
    rng = np.random.default_rng(seed)
    return (locs[rng.integers(len(locs), size=length)] + rng.normal(size=length)).astype("f4")


@pytest.mark.parametrize(("params", "length"), [(TWO, 200), (THREE, 60)])
def test_an_hmm_is_the_hand_written_forward_algorithm(params, length):
    y = data(params[2], length)
    hmm = hmm_of(*params)
    for mu in (0.3, -0.7):
        expected = forward_by_hand(*params, mu, y)
        got = ppl.joint_log_prob(hmm)({"mu": mu, "y": y}, length)
        np.testing.assert_allclose(got, expected, rtol=2e-5)
        density = ppl.unconstrained(hmm, {"y": y})
        np.testing.assert_allclose(
            density.log_density({"mu": jnp.float32(mu)}, length), expected, rtol=2e-5
        )


def test_the_gradient_and_vmap_of_the_forward_pass():
    y = data(TWO[2], 200)
    density = ppl.unconstrained(hmm_of(*TWO), {"y": y})
    mus = jnp.array([-0.5, 0.0, 0.4])
    values = jax.jit(jax.vmap(lambda m: density.log_density({"mu": m}, 200)))(mus)
    np.testing.assert_allclose(values, [forward_by_hand(*TWO, float(m), y) for m in mus], rtol=2e-5)
    grad = jax.grad(lambda m: density.log_density({"mu": m}, 200))(jnp.float32(0.4))
    h = 1e-4
    slope = (forward_by_hand(*TWO, 0.4 + h, y) - forward_by_hand(*TWO, 0.4 - h, y)) / (2 * h)
    np.testing.assert_allclose(grad, slope, rtol=1e-3)


def test_a_length_of_a_thousand_steps_is_scored():
    # Joint enumeration would take 2**1000 assignments; the forward pass takes 1000 steps.
    y = data(TWO[2], 1000, seed=3)
    got = jax.jit(lambda m: ppl.joint_log_prob(hmm_of(*TWO))({"mu": m, "y": y}, 1000))(0.2)
    np.testing.assert_allclose(got, forward_by_hand(*TWO, 0.2, y), rtol=2e-5)


def test_a_mixture_in_a_scan_is_each_step_s_sum():
    y = data(np.array([-2.0, 2.0]), 50, seed=1)

    def mixture(key, n):
        w = ppl.random_variable(tfd.Beta(2.0, 2.0), name="w")(key)

        def step(carry, k):
            k1, k2 = jax.random.split(k)
            z = ppl.random_variable(
                tfd.Bernoulli(probs=w, dtype=jnp.float32), name="z", mode="append", enumerate=True
            )(k1)
            return carry, ppl.random_variable(
                tfd.Normal(4.0 * z - 2.0, 1.0), name="y", mode="append"
            )(k2)

        return jax.lax.scan(step, 0.0, jax.random.split(key, n))[1]

    w = 0.3
    per_point = np.logaddexp(np.log(w) + norm.logpdf(y, 2.0), np.log1p(-w) + norm.logpdf(y, -2.0))
    expected = tfd.Beta(2.0, 2.0).log_prob(w) + per_point.sum()
    np.testing.assert_allclose(
        ppl.joint_log_prob(mixture)({"w": w, "y": y}, 50), expected, rtol=2e-5
    )


def test_a_density_outside_the_steps_that_reads_the_draws_is_refused():
    def leaky(key, n):
        def step(prev, k):
            z = ppl.random_variable(
                tfd.Bernoulli(probs=0.5), name="z", mode="append", enumerate=True
            )(k)
            return z, z

        zs = jax.lax.scan(step, 0, jax.random.split(key, n))[1]
        ppl.factor(jnp.sum(zs[:2]), name="leak")  # not a per-step factor
        return zs

    with pytest.raises(ValueError, match="not shaped like the scan's 5 steps depends on 'z'"):
        ppl.joint_log_prob(leaky)({}, 5)


@pytest.mark.slow  # funsor's first trace takes ~15 s
def test_numpyro_s_markov_enumeration_agrees():
    numpyro = pytest.importorskip("numpyro")
    pytest.importorskip("funsor")
    import numpyro.distributions as dist
    from numpyro.contrib.control_flow import scan as np_scan
    from numpyro.contrib.funsor import enum, log_density

    init, trans, locs = (jnp.asarray(a, jnp.float32) for a in THREE)
    y = jnp.asarray(data(THREE[2], 40, seed=5))

    def np_model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))

        def step(prev, y_t):
            probs = jnp.where(prev < 0, init, trans[jnp.maximum(prev, 0)])
            z = numpyro.sample("z", dist.Categorical(probs), infer={"enumerate": "parallel"})
            numpyro.sample("y", dist.Normal(locs[z] + mu, 1.0), obs=y_t)
            return z, None

        np_scan(step, -1, y)

    def numpyro_lp(mu):
        seeded = numpyro.handlers.substitute(np_model, data={"mu": mu})
        # funsor's log_density sums the enumerated sites out (`markov` through the scan).
        return log_density(enum(seeded, first_available_dim=-1), (y,), {}, {})[0]

    mu = jnp.float32(0.25)
    got = ppl.joint_log_prob(hmm_of(*THREE))({"mu": mu, "y": y}, 40)
    np.testing.assert_allclose(got, numpyro_lp(mu), rtol=2e-5)
