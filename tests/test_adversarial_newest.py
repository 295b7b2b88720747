"""Adversarial checks of the newest code, as a user meets it: each case once gave
silently stale numbers, checked here against the function run by hand.

What a harvested function reads follows `jax.jit`'s rule (docs/semantics.md):
arguments at every call, everything else when it is traced; the cases of that
rule run side by side with `jax.jit` in tests/test_jit_contract.py.
"""

import functools

import jax.numpy as jnp
import numpy as np

from harvest import instrument, reap, sow

X = jnp.arange(1.0, 4.0)  # no zero: a change at any position shows


def test_a_list_the_function_appends_to_is_not_a_key():
    # A list the function closes over is read when it traces: a log of traces.
    traces = []

    def f(x):
        traces.append(x.shape)
        return sow(x * 2.0, name="y", mode="strict")

    reaped = reap(f)
    for _ in range(3):
        np.testing.assert_array_equal(reaped(X)["y"], X * 2.0)
    assert traces == [(3,)]


def test_an_instrumented_partial_sees_its_numpy_argument_changed_in_place():
    weight = np.array([1.0, 2.0, 3.0], np.float32)

    def g(x, weight):
        return jnp.sin(x * weight)

    bound = functools.partial(g, weight=weight)
    reaped = reap(instrument(bound, ops=True), tag="modules")
    site = next(name for name in reaped(X) if name.startswith("sin"))
    weight[:] = [4.0, 5.0, -6.0]
    np.testing.assert_allclose(reaped(X)[site], bound(X))
    np.testing.assert_allclose(reaped(X)[site], jnp.sin(X * weight))
