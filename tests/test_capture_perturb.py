"""`capture` and `perturb` (the first API: `from harvest import sow, capture, perturb`), every example as written."""

import jax
import jax.numpy as jnp
import pytest
from conftest import close
from jax import lax

from harvest import capture, perturb, reap, sow

W1 = jnp.array([[0.5, -0.2], [0.1, 0.3], [-0.4, 0.8]], jnp.float32)  # (3, 2)
W2 = jnp.array([1.0, -1.0], jnp.float32)
X = jnp.array([1.0, -0.5, 2.0], jnp.float32)


def layer(x):
    return jnp.tanh(x @ W1)


def head(y):
    return y @ W2


def f(x):
    y = layer(x)
    sow(y, name="features")  # tag any value, anywhere
    return head(y)


def test_summary_example():
    out, collected = capture(f)(X)
    y = jnp.tanh(X @ W1)
    close(out, y @ W2)
    close(collected, {"features": (y,)})
    assert isinstance(collected["features"], tuple) and len(collected["features"]) == 1


def test_sowing_same_name_twice_gives_both_in_call_order():
    def g(x):
        sow(x, name="n")
        sow(x * 2, name="n")
        return x

    close(capture(g)(X)[1], {"n": (X, X * 2)})


def test_capture_composes_under_jit():
    out, collected = jax.jit(capture(f))(X)
    y = jnp.tanh(X @ W1)
    close((out, collected), (y @ W2, {"features": (y,)}))


def test_nested_jit_flat_namespace_in_call_order():
    @jax.jit
    def inner(x):
        sow(x * 3.0, name="n")
        return x + 1.0

    @jax.jit
    def g(x):
        sow(x, name="n")
        y = jax.jit(inner)(x)
        sow(y, name="n")
        return y

    out, collected = capture(g)(X)
    close(out, X + 1.0)
    close(collected, {"n": (X, X * 3.0, X + 1.0)})


def test_scan_one_pytree_per_name_with_leading_length_axis():
    def g(xs):
        def body(c, x):
            sow({"x": x, "c": c}, name="step")
            return c + x, None

        return lax.scan(body, jnp.zeros(()), xs)[0]

    xs = jnp.array([1.0, 2.0, 3.0, 4.0])
    out, collected = capture(g)(xs)
    close(out, jnp.float32(10.0))
    close(collected, {"step": ({"x": xs, "c": jnp.array([0.0, 1.0, 3.0, 6.0])},)})


def test_cond_example():
    def g(x, p):
        return lax.cond(p, lambda x: sow(x * 2.0, name="b"), lambda x: sow(x - 1.0, name="b"), x)

    close(capture(g)(X, True), (X * 2.0, {"b": (X * 2.0,)}))
    close(capture(g)(X, False), (X - 1.0, {"b": (X - 1.0,)}))


def test_custom_vjp_backward_sow_example():
    @jax.custom_vjp
    def h(x):
        return x**2

    def h_fwd(x):
        return h(x), x

    def h_bwd(x, g):
        gx = 2 * x * g
        sow(gx, name="grad_h")  # sow lives in the BACKWARD rule
        return (gx,)

    h.defvjp(h_fwd, h_bwd)

    def loss(x):
        return jnp.sum(h(x))

    x = jnp.arange(3.0)
    grad, collected = capture(jax.grad(loss))(x)
    close(grad, 2 * x)
    close(collected, {"grad_h": (2 * x,)})
    close(reap(jax.grad(loss))(x), {"grad_h": (2 * x,)})
    close(reap(jax.jit(jax.grad(loss)))(x), {"grad_h": (2 * x,)})
    # The proposal's claim about the jaxpr: the backward sow is a top-level equation.
    jaxpr = jax.make_jaxpr(jax.grad(loss))(x)
    assert any(e.primitive.name == "sow" for e in jaxpr.jaxpr.eqns)


def test_custom_vjp_containing_scan_inside_jit_jit():
    @jax.custom_vjp
    def k(x):
        def body(c, xi):
            sow(c, name="inner")
            return c + xi, None

        return lax.scan(body, 0.0, x)[0]

    k.defvjp(lambda x: (k(x), None), lambda _, g: (jnp.full(3, g),))

    g = jax.jit(jax.jit(k))
    out, collected = capture(g)(X)
    close(out, jnp.sum(X))
    close(collected, {"inner": (jnp.array([0.0, X[0], X[0] + X[1]]),)})


def test_perturb_example():
    def loss(x):
        return jnp.sum(perturb(x, name="grad_x") ** 2)

    grad, collected = capture(jax.grad(loss))(X)
    close(grad, 2 * X)
    close(collected["grad_x"][0], 2 * X)  # == d(loss)/d(x)


def test_capture_grad_with_perturb_under_jit():
    def loss(x):
        y = perturb(layer(x), name="g_y")
        return jnp.sum(head(y) ** 2)

    def ref(x, eps):
        y = layer(x) + eps
        return jnp.sum(head(y) ** 2)

    grad, collected = jax.jit(capture(jax.grad(loss)))(X)
    close(grad, jax.grad(ref)(X, jnp.zeros(2)))
    close(collected, {"g_y": (jax.grad(ref, argnums=1)(X, jnp.zeros(2)),)})


def test_while_loop_collect_gives_clear_error():
    def g(x):
        def body(c):
            sow(c, name="c")
            return c + 1.0

        return lax.while_loop(lambda c: c < 3.0, body, x)

    with pytest.raises(ValueError, match=r"(?s)while_loop.*(scan|sow_cond|clobber)"):
        capture(g)(jnp.float32(0.0))
    # plain evaluation is unaffected
    close(g(jnp.float32(0.0)), jnp.float32(3.0))


def test_sow_runs_under_plain_jit_markers_discarded():
    close(jax.jit(f)(X), jnp.tanh(X @ W1) @ W2)
