"""Issue 24 items 3 and 4: callable plants are traced code, the compile cache is
bounded and says when it keeps recompiling, and a full reap costs what it reaps.

Every result is checked against the function computed by hand."""

from __future__ import annotations

import dataclasses
import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest
from harvest import call_and_reap, plant, reap, sites, sow

X = jnp.arange(3.0)


def counted():
    """A function sowing ``h = 2x`` and returning ``h + 1``, and its list of traces."""
    traces = []

    def f(x):
        traces.append(1)
        return sow(x * 2.0, name="h", mode="strict") + 1.0

    return f, traces


# -- a fresh lambda of the same code is the same program ----------------------


def test_a_fresh_lambda_over_a_new_array_does_not_retrace():
    f, traces = counted()
    g = plant(f)
    for i in range(4):
        d = jnp.full(3, float(i))
        np.testing.assert_allclose(g({"h": lambda o: o + d}, X), X * 2.0 + i + 1.0)
    assert len(traces) == 1


def test_new_shapes_after_the_first_lambda_is_collected():
    f, traces = counted()
    g = plant(f)
    for n in (3, 4, 3):  # one key, two shapes: the second traces with its own lambda
        d = jnp.ones(n)
        np.testing.assert_allclose(
            g({"h": lambda o: o + d}, jnp.arange(n * 1.0)), jnp.arange(n) * 2.0 + 2.0
        )
        gc.collect()
    assert len(traces) == 2


def _adds(d):
    return lambda o: o + d


def _scales(s):
    return lambda o: o * s


def _signs(s):
    return lambda o: o * jnp.copysign(1.0, s)


def test_closed_over_numbers_are_static_by_value():
    f, traces = counted()
    g = plant(f)
    for s in (2.0, 3.0, 2.0):
        np.testing.assert_allclose(g({"h": _scales(s)}, X), X * 2.0 * s + 1.0)
    assert len(traces) == 2  # the second 2.0 reuses the first's program
    for s in (0.0, -0.0, 0.0):  # equal numbers, different programs
        np.testing.assert_allclose(g({"h": _signs(s)}, X), X * 2.0 * np.copysign(1.0, s) + 1.0)


def test_defaults_are_read_like_closed_over_values():
    f, traces = counted()
    g = plant(f)
    for s in (2.0, 5.0):
        np.testing.assert_allclose(g({"h": lambda o, s=s: o * s}, X), X * 2.0 * s + 1.0)
    n = len(traces)
    for i in range(3):
        d = jnp.full(3, float(i))
        np.testing.assert_allclose(g({"h": lambda o, d=d: o + d}, X), X * 2.0 + i + 1.0)
    assert len(traces) == n + 1


SHIFT = 1.0
DELTA = jnp.ones(3)


def test_a_plant_reading_module_level_values_is_keyed_by_identity():
    """A fresh lambda reading a global is a new function each time, as jax.jit keys
    one: it traces again and sees the global's new value, never a stale program."""
    global SHIFT, DELTA
    f, traces = counted()
    g = plant(f)
    try:
        for SHIFT in (1.0, 4.0):
            np.testing.assert_allclose(g({"h": lambda o: o + SHIFT}, X), X * 2.0 + SHIFT + 1.0)
        for i in range(3):
            DELTA = jnp.full(3, float(i))
            np.testing.assert_allclose(g({"h": lambda o: o + DELTA}, X), X * 2.0 + i + 1.0)
        assert len(traces) == 5
    finally:
        SHIFT, DELTA = 1.0, jnp.ones(3)


def test_nested_functions_are_keyed_by_what_they_close_over():
    f, _ = counted()
    g = plant(f)

    def outer(inner):
        return lambda o: inner(o) - 1.0

    for s in (2.0, 3.0):
        np.testing.assert_allclose(g({"h": outer(_scales(s))}, X), X * 2.0 * s)
    for fn in (jnp.sin, jnp.cos):
        np.testing.assert_allclose(g({"h": outer(fn)}, X), fn(X * 2.0))
    d = jnp.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(g({"h": outer(_adds(d))}, X), X * 2.0 + d + 1.0 - 1.0)


def test_lambdas_of_different_code_never_share():
    f, _ = counted()
    g = plant(f)
    d = jnp.ones(3)
    np.testing.assert_allclose(g({"h": lambda o: o + d}, X), X * 2.0 + 2.0)
    np.testing.assert_allclose(g({"h": lambda o: o - d}, X), X * 2.0)


def test_a_lambda_taking_the_occurrence_index():
    def f(xs):
        step = lambda c, x: (c + sow(x, name="x", mode="append"), None)  # noqa: E731
        return jax.lax.scan(step, 0.0, xs)[0]

    for k in (1, 2):
        zero = jnp.asarray(0.0)
        assert float(plant(f)({"x": lambda old, i: jnp.where(i == k, zero, old)}, jnp.ones(4))) == 3


def test_a_plant_writing_a_nonlocal_still_reaches_it():
    f, _ = counted()
    calls = 0

    def counting(o):
        nonlocal calls
        calls += 1
        return o

    plant(f)({"h": counting}, X)
    assert calls == 1


def test_traced_code_plants_under_jit_vmap_and_grad():
    f, traces = counted()

    def planted(d, x):
        return plant(f)({"h": lambda o: o * d}, x).sum()

    x = X + 1.0
    np.testing.assert_allclose(jax.jit(planted)(3.0, x), (x * 6.0 + 1.0).sum())
    np.testing.assert_allclose(jax.grad(planted)(3.0, x), (x * 2.0).sum())
    ds = jnp.array([1.0, 2.0])
    np.testing.assert_allclose(
        jax.vmap(planted, (0, None))(ds, x), [(x * 2 * d + 1).sum() for d in ds]
    )


# -- sweeps read the arrays a plain f closes over -------------------------------


# -- the one warning: a function traced again and again -----------------------


@pytest.fixture
def cache_settings():
    before = harvest.config.warn_after
    yield
    harvest.config.update("warn_after", before)


def test_the_warning_fires_once_after_n_recompiles(cache_settings):
    harvest.config.update("warn_after", 3)

    def f(x, s):
        return sow(x * s, name="h", mode="strict")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in (1.0, 2.0, 3.0):
            np.testing.assert_allclose(reap(f)(X, s)["h"], X * s)
        assert caught == []
        for s in (4.0, 5.0, 6.0):
            np.testing.assert_allclose(reap(f)(X, s)["h"], X * s)
    assert [w.category for w in caught] == [harvest.RecompileWarning]
    message = str(caught[0].message)
    assert "test_plant_cache.py:" in message and "4 times" in message and len(message) < 600
    assert caught[0].filename == __file__  # shown at the function's line, not inside JAX


def _double(x):
    return sow(x * 2.0, name="h", tag="in", mode="strict")


def _triple(x):
    return sow(x * 3.0, name="h", tag="in", mode="strict")


def _halve(x):
    return sow(x * 0.5, name="h", tag="in", mode="strict")


def _negate(x):
    return sow(-x, name="h", tag="in", mode="strict")


def test_functions_behind_one_wrapper_are_counted_apart(cache_settings):
    harvest.config.update("warn_after", 3)
    # Each inner harvest is wrapped by JAX's `api_boundary`, whose code all of them
    # share: counted by that code, four functions traced once each read as one
    # function traced four times, and the warning named the wrapper.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for f, k in [(_double, 2.0), (_triple, 3.0), (_halve, 0.5), (_negate, -1.0)]:
            out, inner = call_and_reap(reap(f, tag="in"), tag="out")(X)
            np.testing.assert_allclose(out["h"], X * k)
            assert inner == {}
    assert caught == []


def test_steady_use_never_warns(cache_settings):
    harvest.config.update("warn_after", 2)
    traces = []

    def f(x):
        traces.append(1)
        return sow(x * 2.0, name="h", mode="strict") + 1.0

    g = plant(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(10):
            d = jnp.full(3, float(i))
            np.testing.assert_allclose(g({"h": lambda o: o + d}, X), X * 2.0 + i + 1.0)
            np.testing.assert_allclose(reap(f)(X + i)["h"], (X + i) * 2.0)
    assert len(traces) == 2  # one plant, one reap


@dataclasses.dataclass
class _Config:  # a dataclass with eq and no frozen: unhashable
    a: float


def test_an_unhashable_argument_warns_once_and_stays_correct():
    def f(x, cfg):
        return sow(x * cfg.a, name="h", mode="strict")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for a in (2.0, 3.0, 4.0):
            np.testing.assert_allclose(reap(f)(X, _Config(a))["h"], X * a)
    assert [w.category for w in caught] == [harvest.RecompileWarning]
    message = str(caught[0].message)
    assert "_Config" in message and "test_plant_cache.py:" in message and len(message) < 600


def test_clear_caches_drops_every_program():
    f, traces = counted()
    np.testing.assert_allclose(reap(f)(X)["h"], X * 2.0)
    harvest.clear_caches()
    np.testing.assert_allclose(reap(f)(X)["h"], X * 2.0)
    assert len(traces) == 2


# -- a full reap's size, from shapes alone ----------------------------------------


def test_sites_bytes_are_the_reaped_bytes():
    def f(xs, w):
        def body(c, x):
            return c + sow(x * c @ w, name="step", mode="append"), None

        h = sow(jnp.tanh(xs), name="h", mode="strict")
        return jax.lax.scan(body, jnp.ones(4), h)[0]

    xs, w = jnp.ones((5, 4)), jnp.eye(4, dtype=jnp.float32)
    found = sites(f)(xs, w)
    reaped = reap(f)(xs, w)
    assert [s.nbytes for s in found] == [reaped["h"].nbytes, reaped["step"].nbytes]
    assert found.nbytes() == sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(reaped))
    assert "bytes" in str(found).splitlines()[0]


def test_sites_bytes_inside_a_while_loop_are_unknown():
    def f(x):
        return jax.lax.while_loop(lambda c: c < 3.0, lambda c: sow(c + 1.0, name="c"), x)

    found = sites(f)(0.0)
    assert found[0].nbytes is None and found.nbytes() is None
    assert "unbounded" in str(found)
