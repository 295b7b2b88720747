"""Reading and patching intermediates of neural-network library modules.

A `sow` from harvest inside a module's `__call__` is an ordinary site: reap,
plant, stream, sites and the patching sweep see it through Flax NNX, Flax
Linen and Equinox exactly as through a plain JAX function.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import ablate_zero, patching_sweep, plant, reap, sites, sow, stream

X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


def check_reap_plant_and_sweep(f, hidden_shape):
    reaped = reap(f)(X)
    assert reaped["hidden"].shape == hidden_shape
    assert [s.name for s in sites(f, X)] == ["hidden"]
    out = plant(f)({"hidden": ablate_zero()}, X)
    np.testing.assert_allclose(out, plant(f)({"hidden": jnp.zeros(hidden_shape)}, X))
    seen = []
    np.testing.assert_allclose(stream(f, lambda n, v: seen.append(n))(X), f(X), rtol=1e-6)
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
