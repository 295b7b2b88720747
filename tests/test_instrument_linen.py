"""instrument on Linen models that use nn.jit, nn.share_scope and tuple outputs (as `gemma` does).

The toy model below reproduces what broke on the `gemma` library: its
`__call__` is wrapped in `nn.jit` (later traces reused the first one, so
reaps after `sites` or a failed call found no sites), its feed-forward applies
two submodules through `nn.share_scope` (one path, two shapes), and its blocks
return `(cache, x)`. References are the forward pass written out by hand
from the parameters.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import call_and_reap, instrument, patching_sweep, plant, reap, sites

nn = pytest.importorskip("flax.linen")

D, H = 3, 4


class Proj(nn.Module):
    features: int
    weight_name: str

    @nn.compact
    def __call__(self, x):
        w = self.param(self.weight_name, nn.initializers.normal(1.0), (x.shape[-1], self.features))
        return x @ w


class FeedForward(nn.Module):
    @nn.compact
    def __call__(self, x):
        gating = Proj(H, "gating")
        nn.share_scope(self, gating)
        linear = Proj(D, "linear")
        nn.share_scope(self, linear)
        return linear(jnp.tanh(gating(x)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, cache, x):
        return cache, x + FeedForward(name="mlp")(x)


class Model(nn.Module):
    @functools.partial(nn.jit, static_argnames=("self",))
    @nn.compact
    def __call__(self, x):
        _, x = Block(name="layer_0")(None, x)
        _, x = Block(name="layer_1")(None, x)
        return x


@pytest.fixture(scope="module")
def setup():
    model = Model()
    x = jax.random.normal(jax.random.key(1), (2, D))
    return model, model.init(jax.random.key(0), x), x


def by_hand(variables, x, patch=None):
    """The forward pass from the parameters; `patch` replaces named values."""
    patch, seen = patch or {}, {}

    def site(name, value):
        value = patch.get(name, value)
        seen[name] = value
        return value

    for layer in ("layer_0", "layer_1"):
        p = variables["params"][layer]["mlp"]
        gate = site(f"{layer}.mlp.Proj_0", x @ p["gating"])
        out = site(f"{layer}.mlp.Proj_1", jnp.tanh(gate) @ p["linear"])
        x = site(layer, x + site(f"{layer}.mlp", out))
    return x, seen


def test_share_scope_children_are_sites_of_their_own(setup):
    model, variables, x = setup
    reaped = reap(instrument(model.apply), tag="modules")(variables, x)
    out, seen = by_hand(variables, x)
    assert set(reaped) == set(seen)
    for name in seen:  # `(None, x)` block outputs are reaped as their array
        np.testing.assert_allclose(reaped[name], seen[name], rtol=1e-6, atol=1e-6)


def test_every_trace_sees_the_sites(setup):
    """After sites(), after a failed call, after a plain call, and with a new shape."""
    model, variables, x = setup
    f = instrument(model.apply)
    model.apply(variables, x)  # a plain call first: nn.jit caches a trace without sows
    assert [s.name for s in sites(f, tag="modules")(variables, x)][:2] == [
        "layer_0.mlp.Proj_0",
        "layer_0.mlp.Proj_1",
    ]
    with pytest.raises(ValueError, match="matches no sow site"):
        reap(f, tag="modules", names="nope")(variables, x)
    assert len(reap(f, tag="modules")(variables, x)) == 8
    wide = jnp.ones((5, D))
    np.testing.assert_allclose(
        reap(f, tag="modules")(variables, wide)["layer_1"], by_hand(variables, wide)[0], rtol=1e-6
    )
    # The plain model is as it was: no sows reach its own traces.
    assert not sites(model.apply)(variables, x)


def test_plant_tuple_outputs_and_shared_scope_children(setup):
    model, variables, x = setup
    f = instrument(model.apply)
    new = jnp.full((2, H), 0.5)
    planted = plant(f, tag="modules")({"layer_0.mlp.Proj_0": new}, variables, x)
    np.testing.assert_allclose(
        planted, by_hand(variables, x, {"layer_0.mlp.Proj_0": new})[0], rtol=1e-6
    )
    # A `(cache, x)` block output is planted by its array.
    zeros = jnp.zeros((2, D))
    planted = plant(f, tag="modules")({"layer_0": zeros}, variables, x)
    np.testing.assert_allclose(planted, by_hand(variables, x, {"layer_0": zeros})[0], rtol=1e-6)
    # Under an outer jit, and in a sweep (which traces again).
    jitted = jax.jit(lambda v, a: plant(f, tag="modules")({"layer_0": lambda o: 2 * o}, v, a))
    np.testing.assert_allclose(
        jitted(variables, x),
        by_hand(variables, x, {"layer_0": 2 * by_hand(variables, x)[1]["layer_0"]})[0],
        rtol=1e-6,
    )
    clean = reap(f, tag="modules")(variables, x)
    result = patching_sweep(f, clean, (variables, -x), lambda out: out.sum(), tag="modules")
    assert len(result.names) == 8
    i = result.names.index("layer_1")
    expected = by_hand(variables, x)[0].sum() - by_hand(variables, -x)[0].sum()
    np.testing.assert_allclose(result.values[i], expected, rtol=1e-5)


class Wide(nn.Module):
    """The model with another structure: a third block."""

    @nn.compact
    def __call__(self, x):
        for i in range(3):
            _, x = Block(name=f"layer_{i}")(None, x)
        return x


def test_eager_calls_read_new_weights_and_see_a_new_structure(setup):
    """An instrumented function holds no state of its own (so an eager call walks its
    arguments only to flatten them), yet each call reads the weights it is given: a new
    `variables` dict, a leaf replaced in the same dict, and another model's structure."""
    from harvest._calling._stateful import Stateful

    model, variables, x = setup
    f = instrument(model.apply)
    assert not isinstance(f, Stateful)
    capture = reap(f, tag="modules")
    capture(variables, x)
    other = model.init(jax.random.key(7), x)
    np.testing.assert_allclose(capture(other, x)["layer_1"], by_hand(other, x)[0], rtol=1e-6)
    mutated = jax.tree_util.tree_map(lambda a: a, variables)  # a dict of the same arrays
    capture(mutated, x)
    mutated["params"]["layer_1"]["mlp"]["linear"] = other["params"]["layer_1"]["mlp"]["linear"]
    expected = by_hand(mutated, x)[0]
    assert not np.allclose(expected, by_hand(variables, x)[0])
    np.testing.assert_allclose(capture(mutated, x)["layer_1"], expected, rtol=1e-6)
    wide = Wide()
    wide_variables = wide.init(jax.random.key(3), x)
    reaped = reap(instrument(wide.apply), tag="modules")(wide_variables, x)
    assert len(reaped) == 12  # four sites per block
    np.testing.assert_allclose(reaped["layer_2"], wide.apply(wide_variables, x), rtol=1e-6)


# -- eager calls: one jax.jit per function, reading what it is given -------------

traces = []  # one entry per trace of `Counted` (Python runs only while tracing)


class Counted(nn.Module):
    @nn.compact
    def __call__(self, x):
        traces.append(x.shape)
        return Block(name="layer_0")(None, x)[1]


def test_eager_calls_trace_once_and_read_the_variables_they_are_given(setup):
    """Eager calls of an instrumented `apply` trace once per shape, yet read new
    weights each call (they are an argument), each against the forward by hand; a
    Python flag among the arguments is static; a callable plant is data."""
    _, _, x = setup
    model = Counted()
    weights = model.init(jax.random.key(0), x)
    other = model.init(jax.random.key(5), x)

    def apply(v, a, double=False):
        out = model.apply(v, a)
        return 2 * out if double else out  # Python control flow on the flag

    capture = reap(instrument(apply), tag="modules")
    both = call_and_reap(instrument(apply), tag="modules")
    planted = plant(instrument(apply), tag="modules")

    def expected(v, a):  # the one block, by hand
        p = v["params"]["layer_0"]["mlp"]
        return a + jnp.tanh(a @ p["gating"]) @ p["linear"]

    traces.clear()
    first = capture(weights, x)
    assert list(first) == ["layer_0.mlp.Proj_0", "layer_0.mlp.Proj_1", "layer_0.mlp", "layer_0"]
    np.testing.assert_allclose(both(weights, x)[0], expected(weights, x), rtol=1e-6)
    ones = {"layer_0": jnp.ones((2, D))}
    np.testing.assert_allclose(planted(ones, weights, x), jnp.ones((2, D)))
    np.testing.assert_allclose(capture(other, x)["layer_0"], expected(other, x), rtol=1e-6)
    mutated = jax.tree_util.tree_map(lambda a: a, weights)
    mutated["params"]["layer_0"]["mlp"]["linear"] = other["params"]["layer_0"]["mlp"]["linear"]
    np.testing.assert_allclose(capture(mutated, x)["layer_0"], expected(mutated, x), rtol=1e-6)
    assert len(traces) == 2  # reap and call_and_reap share one program; plant has its own
    wide = jnp.ones((5, D))
    for _ in range(2):
        np.testing.assert_allclose(capture(weights, wide)["layer_0"], expected(weights, wide))
    assert traces[2:] == [(5, D)]  # the new shape traced once
    out, reaped = both(weights, x, True)
    np.testing.assert_allclose(out, 2 * expected(weights, x), rtol=1e-6)
    np.testing.assert_allclose(reaped["layer_0"], expected(weights, x), rtol=1e-6)
    doubled = {"layer_0": lambda o: 2 * o}
    for _ in range(2):
        np.testing.assert_allclose(
            planted(doubled, weights, x), 2 * expected(weights, x), rtol=1e-6
        )
    assert len(traces) == 5  # the flag and the callable plant: one trace each
    with pytest.raises(ValueError, match="matches no sow site") as error:
        reap(instrument(apply), tag="modules", names="nope")(weights, x)
    assert len(str(error.value)) < 600
