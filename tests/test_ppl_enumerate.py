"""Discrete latents summed out by enumeration: against hand marginalisation and enumeration
by itertools. NumPyro's enumerated mixture posterior (funsor, in the same process) is
checked with the other trial models, in tests/test_ppl_models.py."""

import functools
import itertools

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


def _data(n=40):
    """A two-component mixture: 30% around 2.0, the rest around the known -1.0."""
    k_z, k_y = jax.random.split(jax.random.key(11))
    z = jax.random.bernoulli(k_z, 0.3, (n,))
    return jnp.where(z, 2.0, -1.0) + jax.random.normal(k_y, (n,))


Y = _data()


N = len(Y)


def mixture(key, n=N, one_density=False):
    """`one_density`: the likelihood scores the whole batch as one number (Independent)."""
    kw, km, kz, ky = jax.random.split(key, 4)
    w = ppl.random_variable(tfd.Beta(1.0, 1.0), name="w")(kw)
    mu = ppl.random_variable(tfd.Normal(0.0, 5.0), name="mu")(km)
    z = ppl.random_variable(
        tfd.Bernoulli(probs=jnp.full(n, w), dtype=jnp.float32), name="z", enumerate=True
    )(kz)
    likelihood = tfd.Normal(z * mu - (1.0 - z), 1.0)
    likelihood = tfd.Independent(likelihood, 1) if one_density else likelihood
    return ppl.random_variable(likelihood, name="y")(ky)


def by_hand(w, mu, y):
    per_point = jnp.logaddexp(
        jnp.log(w) + tfd.Normal(mu, 1.0).log_prob(y),
        jnp.log1p(-w) + tfd.Normal(-1.0, 1.0).log_prob(y),
    )
    return tfd.Beta(1.0, 1.0).log_prob(w) + tfd.Normal(0.0, 5.0).log_prob(mu) + per_point.sum()


def test_a_per_point_assignment_is_summed_out_element_by_element():
    values = {"w": 0.3, "mu": 2.0, "y": Y}
    np.testing.assert_allclose(ppl.joint_log_prob(mixture)(values), by_hand(0.3, 2.0, Y), rtol=1e-5)
    grad = jax.grad(lambda m: ppl.joint_log_prob(mixture)({**values, "mu": m}))(2.0)
    np.testing.assert_allclose(grad, jax.grad(lambda m: by_hand(0.3, m, Y))(2.0), rtol=1e-4)
    # A value for the enumerated draw conditions on it instead.
    z = (Y > 0.5).astype(jnp.float32)
    expected = (
        tfd.Beta(1.0, 1.0).log_prob(0.3)
        + tfd.Normal(0.0, 5.0).log_prob(2.0)
        + tfd.Bernoulli(probs=0.3).log_prob(z).sum()
        + tfd.Normal(z * 2.0 - (1.0 - z), 1.0).log_prob(Y).sum()
    )
    np.testing.assert_allclose(ppl.joint_log_prob(mixture)({**values, "z": z}), expected, rtol=1e-5)


def test_a_density_of_another_shape_fed_by_the_batched_draw_is_an_error():
    # y's density is one number for the whole batch, so the sum over z does not factor
    # by element: the right answer needs 2**N terms. It was NaN.
    joint_y = functools.partial(mixture, one_density=True)

    values = {"w": 0.3, "mu": 2.0, "y": Y}
    message = r"'y' \(shape \(\)\), which is not shaped like the draw's batch \(40,\)"
    with pytest.raises(ValueError, match=message):
        ppl.joint_log_prob(joint_y)(values)
    u = {"w": jnp.array(0.0), "mu": jnp.array(2.0)}
    with pytest.raises(ValueError, match=message):
        ppl.unconstrained(joint_y, observed={"y": Y}).log_density(u)
    # With z given, the same model scores as before.
    z = (Y > 0.5).astype(jnp.float32)
    expected = ppl.joint_log_prob(mixture)({**values, "z": z})
    np.testing.assert_allclose(ppl.joint_log_prob(joint_y)({**values, "z": z}), expected, rtol=1e-5)


def test_scalar_draws_are_enumerated_jointly():
    def model(key):
        ka, kb, ky = jax.random.split(key, 3)
        a = ppl.random_variable(
            tfd.Bernoulli(probs=0.3, dtype=jnp.float32), name="a", enumerate=True
        )(ka)
        probs = jnp.array([0.2, 0.3, 0.5])
        b = ppl.random_variable(tfd.Categorical(probs=probs), name="b", enumerate=True)(kb)
        return ppl.random_variable(tfd.Normal(a + b, 1.0), name="y")(ky)

    terms = [
        jnp.log(pa) + jnp.log(pb) + tfd.Normal(a + b, 1.0).log_prob(1.5)
        for (a, pa), (b, pb) in itertools.product([(0, 0.7), (1, 0.3)], enumerate([0.2, 0.3, 0.5]))
    ]
    np.testing.assert_allclose(
        ppl.joint_log_prob(model)({"y": 1.5}), jax.nn.logsumexp(jnp.array(terms)), rtol=1e-5
    )


def test_unconstrained_sums_it_out_and_keeps_it_out_of_the_parameters():
    posterior = ppl.unconstrained(mixture, observed={"y": Y})
    u = {"w": jnp.log(0.3 / 0.7), "mu": jnp.array(2.0)}
    jacobian = jnp.log(0.3) + jnp.log(0.7)  # of the sigmoid onto (0, 1)
    np.testing.assert_allclose(posterior.log_density(u), by_hand(0.3, 2.0, Y) + jacobian, rtol=1e-5)
    assert sorted(posterior.init(jax.random.key(0))) == ["mu", "w"]
    assert sorted(posterior.constrain(u)) == ["mu", "w"]


def test_enumerate_needs_a_finite_support():
    with pytest.raises(TypeError, match="Bernoulli or Categorical"):
        ppl.random_variable(tfd.Poisson(3.0), name="n", enumerate=True)
