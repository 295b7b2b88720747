"""TFP's per-draw computations are traced once per kind of distribution, and give what TFP gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest.ppl as ppl
from harvest.ppl import _tfp_traces
from harvest.ppl._tfp_shim import import_tfp

tfd = import_tfp().distributions


def _model(prior_scale=1.0):
    """A fresh closure of one model, as a notebook cell re-run makes."""

    def model(key):
        k1, k2, k3 = jax.random.split(key, 3)
        scale = ppl.random_variable(tfd.HalfNormal(prior_scale), name="scale")(k1)
        loc = ppl.random_variable(tfd.Sample(tfd.Normal(0.0, 1.0), 3), name="loc")(k2)
        return ppl.random_variable(tfd.Independent(tfd.Normal(loc, scale), 1), name="y")(k3)

    return model


def _by_hand(scale, loc, y, prior_scale=1.0):
    return (
        tfd.HalfNormal(prior_scale).log_prob(scale)
        + tfd.Normal(0.0, 1.0).log_prob(loc).sum()
        + tfd.Normal(loc, scale).log_prob(y).sum()
    )


VALUES = {
    "scale": jnp.array(0.7),
    "loc": jnp.array([0.1, -0.2, 0.3]),
    "y": jnp.array([1.0, 0.0, -1.0]),
}


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls of TFP's log densities of the model's distributions."""
    calls = []
    for dist in (tfd.HalfNormal, tfd.Normal):
        original = dist._log_prob

        def spy(self, *args, original=original, **kwargs):
            calls.append(type(self).__name__)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(dist, "_log_prob", spy)
    return calls


def test_a_fresh_program_of_the_same_model_reuses_the_traces(counted):
    prior = 1.2345  # a distribution no other test draws from: its density is traced here first
    got = jax.jit(ppl.joint_log_prob(_model(prior)))(VALUES)
    np.testing.assert_allclose(got, _by_hand(**VALUES, prior_scale=prior), rtol=1e-6)
    assert "HalfNormal" in counted
    traced = len(counted)
    # A new closure is traced again by harvest, its gradient too, but TFP's densities are not.
    jax.make_jaxpr(ppl.joint_log_prob(_model(prior)))(VALUES)
    jax.make_jaxpr(jax.grad(ppl.joint_log_prob(_model(prior))))(VALUES)
    assert len(counted) == traced


def test_the_unconstrained_density_equals_tfp_through_the_cached_bijector():
    u = {"scale": jnp.array(-0.4), "loc": VALUES["loc"]}
    density = ppl.unconstrained(_model(), observed={"y": VALUES["y"]}).log_density
    to_scale = tfd.HalfNormal(1.0).experimental_default_event_space_bijector()
    scale = to_scale.forward(u["scale"])
    expected = _by_hand(scale, u["loc"], VALUES["y"]) + to_scale.forward_log_det_jacobian(
        u["scale"]
    )
    np.testing.assert_allclose(jax.jit(density)(u), expected, rtol=1e-6)
    np.testing.assert_allclose(density(u), expected, rtol=1e-6)  # eager = jit


def test_descriptions_keep_apart_what_python_equality_merges():
    def desc(dist):
        found = _tfp_traces.described(dist)
        assert found is not None
        return found[0]

    assert desc(tfd.Normal(0.0, 1.0)) == desc(tfd.Normal(0.0, 1.0))
    assert desc(tfd.Normal(0.0, 1.0)) != desc(tfd.Normal(-0.0, 1.0))
    assert desc(tfd.Poisson(rate=1.0)) != desc(tfd.Poisson(rate=1))
    assert desc(tfd.Normal(0.0, 1.0)) != desc(tfd.Normal(0.0, 2.0))
    # Arrays are arguments, not part of the description.
    assert desc(tfd.Normal(jnp.zeros(2), 1.0)) == desc(tfd.Normal(jnp.ones(2), 1.0))


def test_a_distribution_holding_a_callable_is_called_directly():
    def make(loc):
        return tfd.Normal(loc, 1.0)

    dist = tfd.JointDistributionSequential([tfd.Normal(0.0, 1.0), make])
    assert _tfp_traces.described(dist) is None
    value = [jnp.array(0.5), jnp.array(-0.5)]
    ours, theirs = jax.jit(lambda v: (_tfp_traces.log_prob(dist, v), dist.log_prob(v)))(value)
    np.testing.assert_allclose(ours, theirs)


def test_shape_like_arrays_stay_values_and_validating_distributions_are_called_directly():
    # A concrete integer array (a sample shape) is part of the description, by value.
    found = _tfp_traces.described(tfd.Sample(tfd.Normal(0.0, 1.0), np.int32(3)))
    assert found is not None and found[1] == []
    assert found[0] != _tfp_traces.described(tfd.Sample(tfd.Normal(0.0, 1.0), np.int32(4)))[0]
    # validate_args=True: TFP checks concrete arguments as it builds, so no traced copy.
    assert _tfp_traces.described(tfd.Normal(0.0, 1.0, validate_args=True)) is None
    assert _tfp_traces.described(tfd.Sample(tfd.Normal(0.0, 1.0, validate_args=True), 2)) is None

    def model(key):
        return ppl.random_variable(tfd.Sample(tfd.Normal(0.0, 2.0), np.int32(3)), name="x")(key)

    x = jnp.array([0.5, -1.0, 2.0])
    got = jax.jit(ppl.joint_log_prob(model))({"x": x})
    np.testing.assert_allclose(got, tfd.Normal(0.0, 2.0).log_prob(x).sum(), rtol=1e-6)
