"""The calling convention of every transformation: arrays traced, everything else static."""

import dataclasses
import enum
import functools

import conftest
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from harvest import (
    call_and_reap,
    capture,
    harvest,
    nest,
    patching_sweep,
    plant,
    reap,
    sites,
    sow,
    stream,
)

X = jnp.array([0.5, -1.0, 2.0], jnp.float32)


class Act(enum.Enum):
    TANH = "tanh"
    RELU = "relu"


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    act: Act
    scale: float


def model(x, n, training=False, *, act=Act.TANH, scale=1.0, note="", norm=None):
    """A Python-controlled model: `n` sets a loop bound, `training` a branch."""
    assert isinstance(n, int) and isinstance(training, bool) and isinstance(scale, float)
    for i in range(n):
        h = jnp.tanh(x) if act is Act.TANH else jax.nn.relu(x)
        x = sow(scale * h + i, name=f"layer{i}", mode="strict")
    if training:
        x = sow(x * 0.5, name="dropout", mode="strict")
    if norm is not None:
        x = norm(x)
    return x


def reference(x, n, training=False, act=Act.TANH, scale=1.0, norm=None):
    """`model` with its sows written out as returned values."""
    out = {}
    for i in range(n):
        h = jnp.tanh(x) if act is Act.TANH else jax.nn.relu(x)
        x = out[f"layer{i}"] = scale * h + i
    if training:
        x = out["dropout"] = x * 0.5
    if norm is not None:
        x = norm(x)
    return x, out


def close(a, b):
    conftest.close(a, b, rtol=1e-6, atol=1e-6)


@settings(max_examples=6, deadline=None)
@given(
    n=st.integers(0, 4),
    training=st.booleans(),
    act=st.sampled_from(list(Act)),
    scale=st.floats(0.25, 4.0),
)
def test_python_values_reach_the_function_as_themselves(n, training, act, scale):
    out, reaps = call_and_reap(model)(X, n, training=training, act=act, scale=scale, note="x")
    close((out, reaps), reference(X, n, training, act, scale))


def test_every_transformation_takes_python_flags():
    want_out, want = reference(X, 2, True)
    close(reap(model)(X, 2, training=True), want)
    close(capture(model)(X, 2, True), (want_out, want))
    # layer0 := 0, so layer1 = tanh(0) + 1 and dropout halves it.
    close(plant(model)({"layer0": jnp.zeros(3)}, X, 2, training=True), jnp.full(3, 0.5))
    out, reaps = harvest(model)({"layer1": jnp.ones(3)}, X, 2, training=True)
    close((out, reaps), (jnp.full(3, 0.5), {"layer0": want["layer0"], "dropout": jnp.full(3, 0.5)}))
    scoped = lambda x, n: nest(model, scope="m")(x, n)
    close(reap(scoped)(X, 3), {"m": reference(X, 3)[1]})
    assert [s.name for s in sites(model)(X, 3, training=True)] == [
        "layer0",
        "layer1",
        "layer2",
        "dropout",
    ]
    seen = []
    close(stream(model, lambda name, v: seen.append(name))(X, 2, training=True), want_out)
    jax.effects_barrier()
    assert seen == ["layer0", "layer1", "dropout"]


def test_patching_sweep_takes_python_flags():
    clean = reap(model)(X, 2, training=True)
    corrupt = -X
    r = patching_sweep(model, clean, (corrupt, 2, True), jnp.sum, names=["layer0"], axis=0)
    for p in range(3):  # the reference: patch position p of layer0 by hand

        def patched(x):
            h0 = jnp.tanh(x).at[p].set(clean["layer0"][p])
            return (jnp.tanh(h0) + 1.0) * 0.5

        base = jnp.sum(reference(corrupt, 2, True)[0])
        np.testing.assert_allclose(
            r.values[0, p], jnp.sum(patched(corrupt)) - base, rtol=1e-5, atol=1e-6
        )


def test_a_new_python_value_retraces_and_a_repeated_one_does_not():
    traces = []

    def f(x, n, training):
        traces.append((n, training))
        return model(x, n, training)

    g = reap(f)
    for _ in range(3):
        close(g(X, 2, True), reference(X, 2, True)[1])
    assert traces == [(2, True)]
    close(g(X, 3, True), reference(X, 3, True)[1])
    close(g(X + 1.0, 2, True), reference(X + 1.0, 2, True)[1])  # a new array: no trace
    assert traces == [(2, True), (3, True)]


def test_equal_python_values_of_different_types_are_different_keys():
    seen = []

    def f(x, v):
        seen.append(type(v))
        return sow(x * 2, name="h", mode="strict")

    g = reap(f)
    for v in (1, 1.0, True, 1):
        g(X, v)
    assert seen == [int, float, bool]


def test_arrays_are_traced_and_numbers_in_plants_too():
    traces = []

    def f(x, scale):
        traces.append(1)
        return sow(x * scale, name="h", mode="strict") + 1.0

    g = plant(f)
    for v in (0.0, 1.0, 2.0):  # numbers planted as values are data
        close(g({"h": v}, 2.0, jnp.float32(v)), v + 1.0)
    assert len(traces) == 1
    for s in (
        np.float32(1.0),
        np.ones((), np.float32),
        jnp.float32(3.0),
    ):  # NumPy and JAX scalars are arrays
        close(reap(f)(X, s)["h"], X * float(s))
    assert len(traces) == 2


def test_grad_and_jit_over_a_harvest_with_static_arguments():
    def loss(x, n, training):
        return jnp.sum(model(x, n, training))

    g = jax.grad(
        lambda x: jnp.sum(plant(model)({"dropout": lambda v: 3.0 * v}, x, 2, training=True))
    )(X)
    want = jax.grad(lambda x: 3.0 * loss(x, 2, True))(X)
    close(g, want)
    jitted = jax.jit(lambda x: reap(model)(x, 3, training=False))
    close(jitted(X), reference(X, 3)[1])
    # A jitted caller with its own static argument passes it through unchanged.
    static_jit = jax.jit(reap(model), static_argnums=(1, 2))
    close(static_jit(X, 1, True), reference(X, 1, True)[1])


def test_static_callables_configs_and_partials():
    cfg = Config(layers=2, act=Act.RELU, scale=2.0)

    def configured(x, cfg):
        return model(x, cfg.layers, act=cfg.act, scale=cfg.scale, norm=jnp.cumsum)

    close(
        call_and_reap(configured)(X, cfg), reference(X, 2, act=Act.RELU, scale=2.0, norm=jnp.cumsum)
    )
    close(reap(functools.partial(model, n=2))(X), reference(X, 2)[1])
    close(
        reap(functools.partial(model, training=True), exclude="layer*")(X, 1),
        {"dropout": reference(X, 1, True)[1]["dropout"]},
    )


def test_an_unhashable_argument_is_traced_at_every_call():
    @dataclasses.dataclass  # mutable, so not hashable: nothing can be cached on it
    class Mutable:
        layers: int

    traces = []

    def f(x, cfg):
        traces.append(cfg.layers)
        return model(x, cfg.layers)

    cfg = Mutable(1)
    g = reap(f)
    close(g(X, cfg), reference(X, 1)[1])
    cfg.layers = 3  # a cache keyed on this object would now be stale
    close(g(X, cfg), reference(X, 3)[1])
    assert traces == [1, 3]
