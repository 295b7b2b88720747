"""Reading and patching intermediates of neural-network library modules.

A `sow` from harvest inside a module's `__call__` is an ordinary site: reap,
plant, stream, sites and the patching sweep see it through Flax NNX, Flax
Linen and Equinox exactly as through a plain JAX function.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import (
    ablate_zero,
    call_and_reap,
    harvest,
    patching_sweep,
    plant,
    reap,
    sites,
    sow,
    stream,
)

X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


def check_reap_plant_and_sweep(f, hidden_shape):
    reaped = reap(f)(X)
    assert reaped["hidden"].shape == hidden_shape
    assert [s.name for s in sites(f)(X)] == ["hidden"]
    out = plant(f)({"hidden": ablate_zero()}, X)
    np.testing.assert_allclose(out, plant(f)({"hidden": jnp.zeros(hidden_shape)}, X))
    seen = []
    np.testing.assert_allclose(stream(f, lambda n, v: seen.append(n))(X), f(X), rtol=1e-6)
    jax.effects_barrier()  # host callbacks run asynchronously (a TPU returns first)
    assert seen == ["hidden"]
    r = patching_sweep(f, reap(f)(X), (-X,), lambda y: jnp.sum(y), axis=0)
    # Patching every row of the only site recovers the clean output's sum.
    np.testing.assert_allclose(r.values.sum(), jnp.sum(f(X)) - jnp.sum(f(-X)), rtol=1e-4, atol=1e-5)


def test_plain_jax_function():
    w1 = jax.random.normal(jax.random.key(0), (4, 5))
    w2 = jax.random.normal(jax.random.key(1), (5, 2))

    def mlp(x):
        return sow(jax.nn.relu(x @ w1), name="hidden", mode="strict") @ w2

    check_reap_plant_and_sweep(mlp, (3, 5))


def test_flax_nnx_module():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(4, 5, rngs=rngs)
            self.down = nnx.Linear(5, 2, rngs=rngs)

        def __call__(self, x):
            return self.down(sow(nnx.relu(self.up(x)), name="hidden", mode="strict"))

    model = MLP(nnx.Rngs(0))
    check_reap_plant_and_sweep(lambda x: model(x), (3, 5))
    # The module's own state is untouched by harvesting it.
    np.testing.assert_allclose(reap(lambda x: model(x))(X)["hidden"], nnx.relu(model.up(X)))


def test_flax_linen_apply():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = sow(nn.relu(nn.Dense(5)(x)), name="hidden", mode="strict")
            return nn.Dense(2)(h)

    module = MLP()
    params = module.init(jax.random.key(0), X)
    check_reap_plant_and_sweep(lambda x: module.apply(params, x), (3, 5))
    # reap of `apply` itself, with the parameters as an argument, and under jit.
    hidden = jax.jit(reap(module.apply))(params, X)["hidden"]
    assert hidden.shape == (3, 5)


def test_equinox_module():
    eqx = pytest.importorskip("equinox")

    class MLP(eqx.Module):
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.up = eqx.nn.Linear(4, 5, key=k1)
            self.down = eqx.nn.Linear(5, 2, key=k2)

        def __call__(self, x):  # one example; vmapped over the batch below
            return self.down(sow(jax.nn.relu(self.up(x)), name="hidden", mode="strict"))

    model = MLP(jax.random.key(0))
    batched = jax.vmap(model)
    check_reap_plant_and_sweep(batched, (3, 5))
    # The module is a pytree: reap it directly, or pass it through eqx.filter_jit.
    assert reap(model)(X[0])["hidden"].shape == (5,)
    hidden = eqx.filter_jit(lambda m, x: reap(m)(x))(model, X[0])["hidden"]
    np.testing.assert_allclose(hidden, jax.nn.relu(model.up(X[0])), rtol=1e-6)


# ---------------------------------------------------------------------------
# Stateful modules: a harvested call leaves the state a direct call leaves.

XS = jax.random.normal(jax.random.key(7), (6, 4))


def stateful_nnx():
    """An NNX model whose call updates batch statistics, draws dropout masks
    from its `Rngs` and stores Flax's own intermediates."""
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)  # training mode: updates its statistics
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.out = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(self.body(x))

        def body(self, x):
            return sow(self.bn(self.lin(x)), name="normed", mode="strict")

        def head(self, h, rngs=None):
            self.sow(nnx.Intermediate, "normed", h)
            return self.out(self.drop(nnx.relu(h), rngs=rngs))

    return nnx, Net(nnx.Rngs(0, dropout=1))


def assert_same_state(nnx, a, b):
    sa, sb = nnx.state(a), nnx.state(b)
    assert jax.tree_util.tree_structure(sa) == jax.tree_util.tree_structure(sb)
    for u, v in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb)):
        if jnp.issubdtype(u.dtype, jax.dtypes.prng_key):
            u, v = jax.random.key_data(u), jax.random.key_data(v)
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:Using 'Module.sow:DeprecationWarning")
def test_reaping_an_nnx_module_leaves_the_state_a_direct_call_leaves():
    nnx, model = stateful_nnx()
    twin = nnx.clone(model)
    out, reaps = call_and_reap(model)(XS)
    want = twin(XS)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(reaps["normed"], twin.normed.get_value()[0], rtol=1e-5, atol=1e-6)
    assert_same_state(nnx, model, twin)  # statistics, RNG counters, intermediates
    # The RNG counter moved on as the twin's did: the next masks agree.
    np.testing.assert_allclose(model(XS), twin(XS), rtol=1e-5, atol=1e-6)
    h = twin.body(-XS)
    np.testing.assert_allclose(reap(model)(-XS)["normed"], h, rtol=1e-5, atol=1e-6)
    twin.head(h)  # what reap's call did after the sow
    assert_same_state(nnx, model, twin)


@pytest.mark.filterwarnings("ignore:Using 'Module.sow:DeprecationWarning")
def test_planting_into_an_nnx_module_matches_the_hand_patched_call():
    nnx, model = stateful_nnx()
    twin = nnx.clone(model)
    shift = jnp.linspace(0.0, 1.0, 8)
    out = plant(model)({"normed": lambda h: h + shift}, XS)
    want = twin.head(twin.body(XS) + shift)  # patched by hand
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert_same_state(nnx, model, twin)
    np.testing.assert_allclose(model(XS), twin(XS), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:Using 'Module.sow:DeprecationWarning")
def test_nnx_nodes_as_bound_self_arguments_and_keywords():
    nnx, model = stateful_nnx()
    twin = nnx.clone(model)
    rngs, twin_rngs = nnx.Rngs(dropout=3), nnx.Rngs(dropout=3)

    def run(body, head, x, *, rngs):  # a submodule and its parent's method, shared state
        return head(body(x), rngs=rngs)

    out, reaps = harvest(run)({}, model.body, model.head, XS, rngs=rngs)
    h = twin.body(XS)
    np.testing.assert_allclose(out, twin.head(h, rngs=twin_rngs), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(reaps["normed"], h, rtol=1e-5, atol=1e-6)
    assert_same_state(nnx, model, twin)
    assert_same_state(nnx, rngs, twin_rngs)
    # A module inside a container argument, and the same module passed twice.
    out = plant(lambda ms, x: ms["a"].head(ms["b"].body(x)))(
        {"normed": jnp.ones((6, 8))}, {"a": model, "b": model}, XS
    )
    twin.body(XS)  # runs (updating the statistics) though its sow is replaced
    np.testing.assert_allclose(out, twin.head(jnp.ones((6, 8))), rtol=1e-5, atol=1e-6)
    assert_same_state(nnx, model, twin)


def test_a_stateful_module_is_traced_once_for_repeated_calls():
    nnx, model = stateful_nnx()
    twin = nnx.clone(model)
    traces = []

    def forward(m, x):
        traces.append(1)
        return m.out(m.drop(nnx.relu(m.body(x))))

    g = reap(forward)
    for x in (XS, 2 * XS, -XS):
        h = twin.body(x)
        twin.out(twin.drop(nnx.relu(h)))  # the twin draws its mask as forward did
        np.testing.assert_allclose(g(model, x)["normed"], h, rtol=1e-5, atol=1e-6)
    assert len(traces) == 1
    assert_same_state(nnx, model, twin)


@pytest.mark.filterwarnings("ignore:Using 'Module.sow:DeprecationWarning")
def test_harvest_inside_nnx_jit_and_sites_leave_the_state_alone():
    nnx, model = stateful_nnx()
    twin = nnx.clone(model)
    out, reaps = nnx.jit(lambda m, x: call_and_reap(m)(x))(model, XS)
    want = nnx.jit(lambda m, x: m(x))(twin, XS)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(reaps["normed"], twin.normed.get_value()[0], rtol=1e-5, atol=1e-6)
    assert_same_state(nnx, model, twin)
    # Finding sites traces the model without running it.
    assert [s.name for s in sites(model)(XS)] == ["normed"]
    assert_same_state(nnx, model, twin)


def test_linen_apply_with_mutable_collections_returns_them():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            h = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
            h = sow(h, name="normed", mode="strict")
            self.sow("intermediates", "normed", h)
            return nn.Dense(2)(nn.Dropout(0.5, deterministic=not train)(h))

    module = Net()
    variables = module.init(jax.random.key(0), XS, False)
    rngs = {"dropout": jax.random.key(1)}
    mutable = ["batch_stats", "intermediates"]
    (out, updates), reaps = call_and_reap(module.apply)(
        variables, XS, True, mutable=mutable, rngs=rngs
    )
    want, want_updates = module.apply(variables, XS, True, mutable=mutable, rngs=rngs)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(want_updates)
    for u, v in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(want_updates)):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        reaps["normed"], want_updates["intermediates"]["normed"][0], rtol=1e-5, atol=1e-6
    )
    # Planting changes what the mutable collections record downstream.
    (_, planted_updates) = plant(module.apply)(
        {"normed": jnp.zeros((6, 8))}, variables, XS, True, mutable=mutable, rngs=rngs
    )
    np.testing.assert_allclose(planted_updates["intermediates"]["normed"][0], 0.0)
    np.testing.assert_allclose(
        planted_updates["batch_stats"]["BatchNorm_0"]["mean"],
        want_updates["batch_stats"]["BatchNorm_0"]["mean"],
        rtol=1e-5,
        atol=1e-6,
    )
