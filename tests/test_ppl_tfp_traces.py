"""TFP's per-draw computations are traced once per kind of distribution, and give what TFP gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest.ppl as ppl
from harvest.ppl import _tfp_traces
from harvest.ppl._tfp_shim import import_tfp

tfd = import_tfp().distributions


def _model():
    """A fresh closure of one model, as a notebook cell re-run makes."""

    def model(key):
        k1, k2, k3 = jax.random.split(key, 3)
        scale = ppl.random_variable(tfd.HalfNormal(1.0), name="scale")(k1)
        loc = ppl.random_variable(tfd.Sample(tfd.Normal(0.0, 1.0), 3), name="loc")(k2)
        return ppl.random_variable(tfd.Independent(tfd.Normal(loc, scale), 1), name="y")(k3)

    return model


def _by_hand(scale, loc, y):
    return (
        tfd.HalfNormal(1.0).log_prob(scale)
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
    expected = _by_hand(**VALUES)
    first = jax.jit(ppl.joint_log_prob(_model()))(VALUES)
    traced = len(counted)
    assert traced > 0
    second = jax.jit(ppl.joint_log_prob(_model()))(VALUES)  # new closure: retraced by harvest
    assert len(counted) == traced  # ... but TFP's log densities were not run again
    np.testing.assert_allclose(first, expected, rtol=1e-6)
    np.testing.assert_allclose(second, expected, rtol=1e-6)
    grad = jax.grad(ppl.joint_log_prob(_model()))(VALUES)
    np.testing.assert_allclose(
        grad["loc"], jax.grad(_by_hand, argnums=1)(*VALUES.values()), rtol=1e-5
    )


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
