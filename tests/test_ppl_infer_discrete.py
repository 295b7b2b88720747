"""infer_discrete: enumerated draws from their posterior, against the exact conditional."""

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


def at(u, draws, observed):
    """A Posterior holding one continuous point `u`, repeated `draws` times (one chain)."""
    rows = {k: jnp.broadcast_to(jnp.asarray(v), (1, draws, *jnp.shape(v))) for k, v in u.items()}
    zeros = jnp.zeros((1, draws))
    return ppl.Posterior(rows, zeros, rows, zeros > 0, zeros, jnp.ones(1), observed)


def within(freq, p, n, sigmas=4.5):
    sd = np.sqrt(np.maximum(p * (1 - p), 1e-12) / n)
    np.testing.assert_array_less(np.abs(np.asarray(freq) - p), sigmas * sd + 1e-9)


def two_coins(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    loc = ppl.random_variable(tfd.Normal(0.0, 1.0), name="loc")(k1)
    a = ppl.random_variable(tfd.Bernoulli(probs=0.3), name="a", enumerate=True)(k2)
    b = ppl.random_variable(tfd.Bernoulli(probs=0.6), name="b", enumerate=True)(k3)
    return ppl.random_variable(tfd.Normal(loc + 2.0 * a - 1.5 * b, 1.0), name="y")(k4)


def test_scalar_draws_follow_the_exact_joint_posterior():
    n, loc, y = 4000, 0.2, 1.0
    drawn = ppl.infer_discrete(
        two_coins, jax.random.key(0), posterior=at({"loc": loc}, n, {"y": y})
    )
    joint = np.array(
        [
            [
                np.log(pa) + np.log(pb) + norm.logpdf(y, loc + 2.0 * a - 1.5 * b)
                for b, pb in ((0, 0.4), (1, 0.6))
            ]
            for a, pa in ((0, 0.7), (1, 0.3))
        ]
    )
    exact = np.exp(joint - np.logaddexp.reduce(joint.ravel()))
    a, b = np.asarray(drawn["a"][0]), np.asarray(drawn["b"][0])
    freq = [[np.mean((a == i) & (b == j)) for j in (0, 1)] for i in (0, 1)]
    within(np.array(freq), exact, n)


def test_a_per_point_assignment_follows_each_point_s_posterior():
    ys = jnp.array([-3.0, 0.2, 2.5, 6.0])

    def mixture(key):
        kw, kz, ky = jax.random.split(key, 3)
        w = ppl.random_variable(tfd.Beta(1.0, 1.0), name="w")(kw)
        z = ppl.random_variable(
            tfd.Bernoulli(probs=jnp.full(4, w), dtype=jnp.float32), name="z", enumerate=True
        )(kz)
        return ppl.random_variable(tfd.Normal(4.0 * z - 1.0, 1.0), name="y")(ky)

    n, w = 4000, 0.4
    posterior = at(
        {"w": tfd.Beta(1.0, 1.0).experimental_default_event_space_bijector().inverse(w)},
        n,
        {"y": ys},
    )
    z = np.asarray(ppl.infer_discrete(mixture, jax.random.key(1), posterior=posterior)["z"][0])
    one = np.log(w) + norm.logpdf(ys, 3.0)
    exact = np.exp(one - np.logaddexp(one, np.log1p(-w) + norm.logpdf(ys, -1.0)))
    within(z.mean(axis=0), exact, n)


def test_forward_filtering_backward_sampling_follows_the_smoothed_posterior():
    init, trans, locs = (
        np.array([0.6, 0.4]),
        np.array([[0.85, 0.15], [0.3, 0.7]]),
        np.array([-1.0, 1.0]),
    )
    rng = np.random.default_rng(2)
    y = (locs[rng.integers(2, size=12)] + rng.normal(size=12)).astype("f4")

    def hmm(key):
        mu = ppl.random_variable(tfd.Normal(0.0, 1.0), name="mu")(key)

        def step(prev, k):
            k1, k2 = jax.random.split(k)
            probs = jnp.where(prev < 0, init, jnp.asarray(trans, jnp.float32)[jnp.maximum(prev, 0)])
            z = ppl.random_variable(
                tfd.Categorical(probs=probs.astype(jnp.float32)),
                name="z",
                mode="append",
                enumerate=True,
            )(k1)
            yy = ppl.random_variable(
                tfd.Normal(jnp.asarray(locs, jnp.float32)[z] + mu, 1.0), name="y", mode="append"
            )(k2)
            return z, yy

        return jax.lax.scan(step, -1, jax.random.split(key, 12))[1]

    n, mu = 4000, 0.1
    posterior = at({"mu": mu}, n, {"y": y})
    z = np.asarray(ppl.infer_discrete(hmm, jax.random.key(3), posterior=posterior)["z"][0])
    # Forward-backward smoothing by hand: P(z[t] = 1 | y), and P(z[t] = 1, z[t+1] = 1 | y).
    emit = norm.logpdf(y[:, None].astype(float), locs[None] + mu, 1.0)
    alpha, beta = np.zeros((12, 2)), np.zeros((12, 2))
    alpha[0] = np.log(init) + emit[0]
    for t in range(1, 12):
        alpha[t] = np.logaddexp.reduce(alpha[t - 1][:, None] + np.log(trans), axis=0) + emit[t]
    for t in range(10, -1, -1):
        beta[t] = np.logaddexp.reduce(np.log(trans) + emit[t + 1] + beta[t + 1], axis=1)
    total = np.logaddexp.reduce(alpha[-1])
    within(z.mean(axis=0), np.exp(alpha[:, 1] + beta[:, 1] - total), n)
    pair = np.exp(alpha[:-1, 1] + np.log(trans[1, 1]) + emit[1:, 1] + beta[1:, 1] - total)
    within(((z[:, :-1] == 1) & (z[:, 1:] == 1)).mean(axis=0), pair, n)


def mixture_at_plus_minus_five(key):
    k1, k2, k3 = jax.random.split(key, 3)
    scale = ppl.random_variable(tfd.HalfNormal(1.0), name="scale")(k1)
    z = ppl.random_variable(tfd.Bernoulli(probs=0.5), name="z", enumerate=True)(k2)
    return ppl.random_variable(tfd.Normal(10.0 * z - 5.0, scale), name="y")(k3)


def test_predictive_draws_the_enumerated_draw_from_its_posterior_when_asked():
    # The case: y = 5 between components at -5 and +5. P(z = 1 | y) is 1 to float
    # precision; from the prior (the default, documented) z = 1 in about half the runs.
    posterior = at({"scale": jnp.float32(0.5)}, 400, {"y": 5.0})
    prior_z = ppl.predictive(mixture_at_plus_minus_five, jax.random.key(4), posterior=posterior)[
        "z"
    ]
    assert 0.35 < float(prior_z.mean()) < 0.65
    z = ppl.predictive(
        mixture_at_plus_minus_five, jax.random.key(4), posterior=posterior, infer_discrete=True
    )["z"]
    assert bool(jnp.all(z == 1))


def test_bad_calls_say_what_is_wrong():
    with pytest.raises(ValueError, match="no free enumerated draw"):
        ppl.infer_discrete(
            lambda k: ppl.random_variable(tfd.Normal(0.0, 1.0), name="m")(k),
            jax.random.key(0),
            posterior=at({"m": 0.0}, 2, {}),
        )
    with pytest.raises(TypeError, match="must be a Posterior"):
        ppl.infer_discrete(two_coins, jax.random.key(0), posterior={"loc": 0.0})
    with pytest.raises(TypeError, match="must be a Posterior"):
        ppl.infer_discrete(two_coins, jax.random.key(0))  # posterior= forgotten
    with pytest.raises(ValueError, match="needs a Posterior"):
        ppl.predictive(two_coins, jax.random.key(0), num_samples=3, infer_discrete=True)
