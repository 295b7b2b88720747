"""harvest.compat.oryx.ppl follows oryx.core.ppl's calling conventions."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest.compat.oryx import ppl
from harvest.ppl._tfp_shim import import_tfp

tfp = import_tfp()  # a statement, so the import sorter keeps it after harvest's shim

tfd = tfp.distributions
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorflow_probability")


def model(key):
    k1, k2 = jax.random.split(key)
    z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
    return z + ppl.random_variable(jax.random.normal, name="x")(k2)


def test_tag_name_is_oryx_s():
    assert ppl.RANDOM_VARIABLE == "random_variable"
    assert ppl.rv is ppl.random_variable


def test_joint_sample_intervene_and_conditional_conventions():
    key = jax.random.PRNGKey(0)
    values = ppl.joint_sample(model)(key)
    assert sorted(values) == ["x", "z"]
    np.testing.assert_allclose(model(key), values["z"] + values["x"], rtol=1e-6)
    assert ppl.intervene(model, z=1.0, x=1.0)(key) == 2.0
    assert ppl.conditional(model, ["z", "x"])(key, 1.0, 2.0) == 3.0  # values come last
    np.testing.assert_allclose(ppl.conditional(model, "z")(key, 1.0), 1.0 + values["x"], rtol=1e-6)
    assert list(ppl.joint_sample(ppl.intervene(model, z=1.0))(key)) == ["x"]


def test_joint_log_prob_and_log_prob():
    def normals(key):
        k1, k2 = jax.random.split(key)
        a = ppl.random_variable(tfd.Normal(0.0, 1.0), name="a")(k1)
        return [a, ppl.random_variable(tfd.Normal(0.0, 1.0), name="b")(k2)]

    np.testing.assert_allclose(ppl.log_prob(normals)([0.0, 0.0]), -1.837877, rtol=1e-6)
    np.testing.assert_allclose(
        ppl.joint_log_prob(normals)({"a": 0.0, "b": 0.0}), -1.837877, rtol=1e-6
    )
    np.testing.assert_allclose(ppl.log_prob(tfd.Normal(0.0, 1.0))(0.0), -0.9189385, rtol=1e-6)


def test_function_random_variable_tags_the_output_and_intervenes():
    def outer(key):
        return ppl.random_variable(lambda k: jax.random.normal(k) * 2.0, name="y")(key)

    key = jax.random.PRNGKey(1)
    assert ppl.joint_sample(outer)(key)["y"] == outer(key)
    out, draws = jax.jit(
        lambda k: (ppl.intervene(outer, y=5.0)(k), ppl.joint_sample(ppl.intervene(outer, y=5.0))(k))
    )(key)
    assert out == 5.0 and draws == {}


def test_untagged_and_value_forms():
    sampler = ppl.random_variable(tfd.Normal(0.0, 1.0))
    assert ppl.joint_sample(sampler)(jax.random.PRNGKey(0)) == {}
    with pytest.raises(ValueError, match="without passing in a name"):
        ppl.random_variable(jnp.ones(2))
    with pytest.raises(ValueError, match="with a plate"):
        ppl.random_variable(jnp.ones(2), name="w", plate="p")


def test_an_unnamed_draw_is_scored_by_its_distribution_as_oryx_does():
    # oryx 0.2.9 scores an unnamed draw by dist.log_prob wherever the output determines it.
    standard = tfd.Normal(0.0, 1.0)
    unnamed = ppl.random_variable(standard)
    np.testing.assert_allclose(ppl.log_prob(lambda k: unnamed(k))(0.3), standard.log_prob(0.3))
    lognormal = ppl.log_prob(lambda k: jnp.exp(unnamed(k)))(2.0)
    np.testing.assert_allclose(lognormal, standard.log_prob(jnp.log(2.0)) - jnp.log(2.0), rtol=1e-6)
    # Under a plate every index reports the whole plate's density.
    plated = ppl.random_variable(standard, plate="p")
    xs = jnp.array([0.0, 1.0, -2.0])
    out = jax.vmap(ppl.log_prob(plated), axis_name="p")(xs)
    np.testing.assert_allclose(out, np.full(3, standard.log_prob(xs).sum()), rtol=1e-6)

    def with_latent(key):  # the output does not determine the first draw: an error in oryx
        k1, k2 = jax.random.split(key)
        return ppl.random_variable(tfd.Normal(unnamed(k1), 1.0))(k2)

    with pytest.raises(ValueError, match="cannot be recovered"):
        ppl.log_prob(with_latent)(0.1)


def test_plate_draws_per_index_and_sums_density_over_the_named_axis():
    @ppl.plate(name="foo")
    @ppl.plate(name="bar")
    def plated(key):
        return ppl.random_variable(tfd.Normal(0.0, 1.0), name="x")(key)

    draws = jax.vmap(
        jax.vmap(plated, axis_name="bar", in_axes=None, axis_size=2),
        axis_name="foo",
        in_axes=None,
        axis_size=3,
    )(jax.random.PRNGKey(0))
    assert len(set(np.asarray(draws).ravel().tolist())) == 6
    xs = jnp.arange(6.0).reshape(3, 2)
    out = jax.vmap(jax.vmap(ppl.log_prob(plated), axis_name="bar"), axis_name="foo")(xs)
    np.testing.assert_allclose(
        out, np.full((3, 2), tfd.Normal(0.0, 1.0).log_prob(jnp.arange(6.0)).sum()), rtol=1e-5
    )


def test_plate_keyword_of_random_variable():
    sampler = ppl.random_variable(tfd.Normal(0.0, 1.0), name="x", plate="p")
    out = jax.vmap(ppl.log_prob(sampler), axis_name="p")(jnp.zeros(4))
    np.testing.assert_allclose(out, np.full(4, 4 * -0.9189385), rtol=1e-5)


def test_docstring_examples():
    assert doctest.testmod(ppl, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0


def test_graph_replace_keeps_oryx_s_disconnected_draws():
    # oryx 0.2.9 re-sows the kept draws at the end: intervening on x no longer moves y.
    def chain(key):
        k1, k2, k3 = jax.random.split(key, 3)
        z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
        x = ppl.random_variable(tfd.Normal(z, 1.0), name="x")(k2)
        return ppl.random_variable(tfd.Normal(x, 1.0), name="y")(k3)

    key = jax.random.PRNGKey(0)
    z_to_y = ppl.graph_replace(chain, "z", "y")
    assert list(ppl.joint_sample(z_to_y)(key, 0.0)) == ["x"]
    np.testing.assert_allclose(ppl.intervene(z_to_y, x=100.0)(key, 0.0), z_to_y(key, 0.0))
