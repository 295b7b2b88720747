"""log_prob by inversion (harvest/ppl/_inverse.py, _log_prob.py) against TFP's bijectors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import harvest.ppl as ppl
from harvest.ppl._tfp_shim import import_tfp

tfp = import_tfp()  # a statement, so the import sorter keeps it after harvest's shim

tfd, tfb = tfp.distributions, tfp.bijectors
pytestmark = [
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorflow_probability"),
]
few = settings(max_examples=6, deadline=None)


def close(a, b, rtol=1e-4):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-4)


def base(key, shape=()):
    return ppl.random_variable(tfd.Normal(jnp.zeros(shape), 1.0), name="z")(key)


# (program transforming the draw, the same map as a TFP bijector, a point in its range)
CASES = {
    "exp": (lambda z: jnp.exp(z), tfb.Exp(), 1.7),
    "log1p_of_exp": (lambda z: jnp.log1p(jnp.exp(z)), tfb.Chain([tfb.Log1p(), tfb.Exp()]), 0.9),
    "affine": (lambda z: 3.0 * z - 2.0, tfb.Chain([tfb.Shift(-2.0), tfb.Scale(3.0)]), 0.4),
    "divide_and_negate": (lambda z: -(z / 4.0), tfb.Chain([tfb.Scale(-1.0), tfb.Scale(0.25)]), 0.3),
    "tanh": (jnp.tanh, tfb.Tanh(), 0.6),
    "sigmoid": (jax.nn.sigmoid, tfb.Sigmoid(), 0.2),
    "softplus_shifted": (
        lambda z: jax.nn.softplus(z + 1.0),
        tfb.Chain([tfb.Softplus(), tfb.Shift(1.0)]),
        2.5,
    ),
    "expm1": (jnp.expm1, tfb.Chain([tfb.Shift(-1.0), tfb.Exp()]), 0.5),
    "sqrt_of_exp": (
        lambda z: jnp.sqrt(jnp.exp(z)),
        tfb.Chain([tfb.Scale(1.0), tfb.Exp(), tfb.Scale(0.5)]),
        1.3,
    ),
    "jitted_exp": (jax.jit(jnp.exp), tfb.Exp(), 0.8),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scalar_bijections_match_tfp_transformed_distributions(name):
    fn, bijector, y = CASES[name]
    reference = tfd.TransformedDistribution(tfd.Normal(0.0, 1.0), bijector)
    close(ppl.log_prob(lambda key: fn(base(key)))(y), reference.log_prob(y))


@few
@given(
    values=st.lists(st.floats(-2.0, 2.0, allow_nan=False, width=32), min_size=6, max_size=6),
    scale=st.floats(0.5, 3.0, width=32),
)
def test_reshape_transpose_and_scale_of_a_vector(values, scale):
    def program(key):
        z = base(key, (6,))
        return jnp.transpose(jnp.reshape(scale * z, (2, 3)))

    x = jnp.asarray(values, jnp.float32)
    expected = tfd.Normal(0.0, scale).log_prob(x).sum()
    close(ppl.log_prob(program)(jnp.transpose(jnp.reshape(x, (2, 3)))), expected)


def test_cumsum_is_a_random_walk():
    def walk(key):
        return jnp.cumsum(base(key, (5,)))

    steps = jnp.array([0.1, -0.4, 0.3, 1.0, -0.2])
    close(ppl.log_prob(walk)(jnp.cumsum(steps)), tfd.Normal(0.0, 1.0).log_prob(steps).sum())


def test_dependent_draws_invert_through_the_other_draw():
    def model(key):
        k1, k2 = jax.random.split(key)
        z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
        x = ppl.random_variable(tfd.Normal(0.0, 1.0), name="x")(k2)
        return z, jnp.exp(x + z)

    z, y = 0.5, 2.0
    x = jnp.log(y) - z
    expected = tfd.Normal(0.0, 1.0).log_prob(z) + tfd.Normal(0.0, 1.0).log_prob(x) - jnp.log(y)
    close(ppl.log_prob(model)((z, y)), expected)


def test_log_prob_of_joint_sample_is_joint_log_prob_also_in_scan():
    def ar1(key):
        def step(x, k):
            x = ppl.random_variable(tfd.Normal(0.8 * x, 1.0), name="x", mode="append")(k)
            return x, None

        return jax.lax.scan(step, 0.0, jax.random.split(key, 4))[0]

    values = ppl.joint_sample(ar1)(jax.random.key(1))
    close(ppl.log_prob(ppl.joint_sample(ar1))(values), ppl.joint_log_prob(ar1)(values))


def test_draws_the_output_does_not_depend_on_integrate_out():
    def model(key):
        k1, k2 = jax.random.split(key)
        ppl.random_variable(tfd.Normal(0.0, 1.0), name="unused")(k1)
        return ppl.random_variable(tfd.Normal(0.0, 2.0), name="y")(k2)

    close(ppl.log_prob(model)(1.0), tfd.Normal(0.0, 2.0).log_prob(1.0))


def test_jit_vmap_and_grad_of_log_prob():
    lp = ppl.log_prob(lambda key: jnp.exp(base(key)))
    ys = jnp.array([0.5, 1.0, 2.0])
    reference = tfd.LogNormal(0.0, 1.0)
    close(jax.jit(jax.vmap(lp))(ys), reference.log_prob(ys))
    close(jax.grad(lp)(1.5), jax.grad(reference.log_prob)(1.5))


def test_factor_is_added_and_plain_samplers_are_refused():
    def weighted(key):
        z = base(key)
        ppl.factor(-(z**2), name="penalty")
        return z

    close(ppl.log_prob(weighted)(1.0), tfd.Normal(0.0, 1.0).log_prob(1.0) - 1.0)
    with pytest.raises(ValueError, match="plain sampling function"):
        ppl.log_prob(ppl.random_variable(jax.random.normal, name="u"))(0.0)


def test_errors_name_the_latent_and_the_primitive_that_stopped_the_way_back():
    with pytest.raises(ValueError, match=r"random variable 'z'.*stopped at: `integer_pow`"):
        ppl.log_prob(lambda key: base(key) ** 2)(1.0)
    with pytest.raises(ValueError, match=r"random variable 'z'.*`add`"):
        ppl.log_prob(
            lambda key: base(key) + ppl.random_variable(tfd.Normal(0.0, 1.0), name="w")(key)
        )(1.0)
    with pytest.raises(ValueError, match="shaped like f's output"):
        ppl.log_prob(lambda key: (base(key), base(key)))(1.0)


def test_broadcast_operands_are_not_inverted():
    # z (a scalar) broadcast against a vector is not a bijection onto the vector.
    with pytest.raises(ValueError, match="Cannot compute log_prob"):
        ppl.log_prob(lambda key: base(key) + jnp.zeros(3))(jnp.ones(3))
