"""Scoring a program does not sample it: a zero of each draw's shape stands in for its sample."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest.ppl as ppl
from harvest.ppl._random_variable import _sample_shape
from harvest.ppl._tfp_shim import import_tfp

tfd = import_tfp().distributions
tfb = import_tfp().bijectors


def _model(key):
    k_w, k_scale, k_z, k_steps, k_y = jax.random.split(key, 5)
    w = ppl.random_variable(tfd.Beta(2.0, 2.0), name="w")(k_w)
    scale = ppl.random_variable(tfd.HalfNormal(1.0), name="scale")(k_scale)
    z = ppl.random_variable(tfd.Bernoulli(probs=w), name="z", enumerate=True)(k_z)

    def step(x, k):
        x = ppl.random_variable(tfd.Normal(0.5 * x, scale), name="x", mode="append")(k)
        return x, x

    _, xs = jax.lax.scan(step, jnp.zeros(()), jax.random.split(k_steps, 3))
    loc = 2.0 * z + xs.sum()
    return ppl.random_variable(tfd.Normal(loc, 1.0), name="y")(k_y)


def _by_hand(w, scale, xs, y):
    """The model's density with z summed out, written with TFP directly."""
    steps = tfd.Normal(0.5 * jnp.concatenate([jnp.zeros(1), xs[:-1]]), scale).log_prob(xs).sum()
    per_z = tfd.Normal(jnp.array([0.0, 2.0]) + xs.sum(), 1.0).log_prob(y) + jnp.log(
        jnp.stack([1.0 - w, w])
    )
    prior = tfd.Beta(2.0, 2.0).log_prob(w) + tfd.HalfNormal(1.0).log_prob(scale)
    return prior + steps + jax.nn.logsumexp(per_z)


W, SCALE, XS, Y = jnp.array(0.3), jnp.array(0.8), jnp.array([0.1, -0.4, 0.3]), 0.7


@pytest.fixture
def samplers_refuse(monkeypatch):
    """Makes every sampler the model uses raise, so a density that samples fails."""

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__}.sample was traced while scoring")

    for dist in (tfd.Beta, tfd.HalfNormal, tfd.Bernoulli, tfd.Normal):
        monkeypatch.setattr(dist, "_sample_n", refuse)


def test_joint_log_prob_traces_no_sampler(samplers_refuse):
    values = {"w": W, "scale": SCALE, "x": XS, "y": Y}
    got = ppl.joint_log_prob(_model)(values)
    np.testing.assert_allclose(got, _by_hand(W, SCALE, XS, Y), rtol=1e-6)
    grad = jax.grad(ppl.joint_log_prob(_model))(values)["scale"]
    expected = jax.grad(_by_hand, argnums=1)(W, SCALE, XS, Y)
    np.testing.assert_allclose(grad, expected, rtol=1e-5)


def test_unconstrained_density_traces_no_sampler_under_intervene_and_block(samplers_refuse):
    to_w, to_scale = tfb.Sigmoid(), tfb.Softplus()
    u = {"w": to_w.inverse(W), "scale": to_scale.inverse(SCALE), "x": XS}
    jacobian = to_w.forward_log_det_jacobian(u["w"], 0) + to_scale.forward_log_det_jacobian(
        u["scale"], 0
    )
    density = ppl.unconstrained(_model, observed={"y": Y}).log_density
    np.testing.assert_allclose(jax.jit(density)(u), _by_hand(W, SCALE, XS, Y) + jacobian, rtol=1e-5)

    # do(scale = 2): scale leaves the parameter space and its density is dropped.
    fixed = ppl.unconstrained(ppl.intervene(_model, scale=2.0), observed={"y": Y}).log_density
    without = {k: v for k, v in u.items() if k != "scale"}
    hand = _by_hand(W, 2.0, XS, Y) - tfd.HalfNormal(1.0).log_prob(2.0)
    jac_w = to_w.forward_log_det_jacobian(u["w"], 0)
    np.testing.assert_allclose(jax.jit(fixed)(without), hand + jac_w, rtol=1e-5)

    # A blocked observation is integrated out: no y term, no z to sum.
    blocked = ppl.unconstrained(ppl.block(_model, "y")).log_density
    hand = (
        tfd.Beta(2.0, 2.0).log_prob(W)
        + tfd.HalfNormal(1.0).log_prob(SCALE)
        + tfd.Normal(0.5 * jnp.array([0.0, 0.1, -0.4]), SCALE).log_prob(XS).sum()
    )
    np.testing.assert_allclose(jax.jit(blocked)(u), hand + jacobian, rtol=1e-5)


def test_prior_draws_still_sample():
    draws = ppl.joint_sample(_model)(jax.random.key(0))
    start = ppl.unconstrained(_model, observed={"y": Y}).init(jax.random.key(0))
    assert float(draws["scale"]) > 0 and float(jnp.sum(jnp.abs(start["x"]))) > 0


@pytest.mark.parametrize(
    "dist",
    [
        tfd.Normal(jnp.zeros(2), 1.0),
        tfd.Sample(tfd.Normal(0.0, 1.0), 8),
        tfd.Independent(tfd.Normal(jnp.zeros((2, 3)), 1.0), 1),
        tfd.Bernoulli(logits=jnp.zeros(3), dtype=jnp.float32),
        tfd.Categorical(logits=jnp.zeros((2, 4))),
        tfd.Poisson(jnp.ones(4)),
        tfd.MultivariateNormalDiag(jnp.zeros(2)),
    ],
)
def test_the_stand_in_has_the_sample_s_shape_and_dtype(dist):
    sample = jax.eval_shape(lambda k: dist.sample(seed=k), jax.random.PRNGKey(0))
    assert _sample_shape(dist) == (sample.shape, sample.dtype)


def test_a_distribution_without_static_shapes_is_sampled():
    class Flat:
        """Duck-typed: samples and scores, states no shapes."""

        def sample(self, seed):
            return jax.random.normal(seed, (2,))

        def log_prob(self, value):
            return -0.5 * jnp.sum(value**2)

    assert _sample_shape(Flat()) is None
    model = lambda key: ppl.random_variable(Flat(), name="v")(key)  # noqa: E731
    np.testing.assert_allclose(ppl.joint_log_prob(model)({"v": jnp.ones(2)}), -1.0)


# -- how often a score traces the model, and walks it -------------------------


@pytest.fixture
def walks(monkeypatch):
    """Counts the core's walks (each interprets one traced program)."""
    from harvest._calling import _run_walk as _transforms

    count = []
    interpret = _transforms.interpret

    def counting(*args, **kwargs):
        count.append(1)
        return interpret(*args, **kwargs)

    monkeypatch.setattr(_transforms, "interpret", counting)
    return count


def _counted():
    """A fresh copy of `_model` (nothing of it cached) and the list of its traces."""
    traces = []

    def model(key):
        traces.append(1)
        return _model(key)

    return model, traces


def test_a_density_walks_the_model_once_per_trace(walks):
    # One walk plants the values and reaps every ppl tag; z, enumerated, is summed
    # out by a second trace and walk, under vmap over its support.
    values = {"w": W, "scale": SCALE, "x": XS, "y": Y}
    model, traces = _counted()
    np.testing.assert_allclose(
        jax.jit(ppl.joint_log_prob(model))(values), _by_hand(W, SCALE, XS, Y), rtol=1e-6
    )
    assert (len(traces), len(walks)) == (2, 2)
    # z fixed by intervene: one trace; intervene's own walk (plant the value, drop its
    # density) comes before the density's one.
    model, traces = _counted()
    walks.clear()
    jax.jit(ppl.joint_log_prob(ppl.intervene(model, z=1.0)))(values)
    assert (len(traces), len(walks)) == (1, 2)
    # unconstrained's gradient under jit: one trace; intervene's walk and the density's
    # (u and y planted, every ppl tag reaped).
    model, traces = _counted()
    walks.clear()
    fixed = ppl.unconstrained(ppl.intervene(model, z=1.0), observed={"y": Y})
    u = {"w": jnp.array(0.1), "scale": jnp.array(-0.2), "x": XS}
    jax.jit(jax.grad(fixed.log_density))(u)
    assert (len(traces), len(walks)) == (1, 2)
    # block: one walk hides y and drops its density, under each of the three traces
    # (the density, z summed out, and the check that no counted density reads y).
    model, traces = _counted()
    walks.clear()
    jax.jit(ppl.joint_log_prob(ppl.block(model, "y")))({"w": W, "scale": SCALE, "x": XS})
    assert (len(traces), len(walks)) == (3, 6)


def test_eager_scores_are_the_jitted_ones():
    values = {"w": W, "scale": SCALE, "x": XS, "y": Y}
    score = ppl.joint_log_prob(_counted()[0])
    first, again, jitted = score(values), score(values), jax.jit(score)(values)
    np.testing.assert_allclose(first, _by_hand(W, SCALE, XS, Y), rtol=1e-6)
    assert first == again == jitted
    density = ppl.unconstrained(ppl.block(_counted()[0], "y")).log_density
    u = {"w": jnp.array(0.1), "scale": jnp.array(-0.2), "x": XS}
    np.testing.assert_allclose(density(u), jax.jit(density)(u), rtol=1e-6)
