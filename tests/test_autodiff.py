"""Autodiff: grad/jvp/vjp of harvested functions, harvesting differentiated functions,
custom derivatives, hijax backward rules, and perturb."""

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.hijax import VJPHiPrimitive

from harvest import call_and_reap, harvest, perturb, plant, reap, sow


def close(a, b):
    conftest.close(a, b, rtol=1e-5, atol=1e-5)


X = jnp.array([0.5, -1.0, 2.0], jnp.float32)
V = jnp.array([0.3, 0.1, -0.4], jnp.float32)


def f(x):
    h = sow(jnp.sin(x) * x, name="h", mode="strict")
    return jnp.sum(jnp.tanh(h) * x)


def f_of_h(x, h):
    """f with `h` an input: the hand-written reference for planting h."""
    return jnp.sum(jnp.tanh(h) * x)


# ---------------------------------------------------------------------------
# Derivatives of harvested functions


def test_grad_wrt_planted_value():
    g = jax.grad(lambda v: plant(f)({"h": v}, X))(V)
    close(g, jax.grad(f_of_h, argnums=1)(X, V))
    # and w.r.t. x with h planted: only the direct dependence remains
    gx = jax.grad(lambda x: plant(f)({"h": V}, x))(X)
    close(gx, jax.grad(f_of_h, argnums=0)(X, V))


def test_jvp_and_vjp_of_planted():
    fp = lambda x, v: plant(f)({"h": v}, x)
    tx, tv = jnp.array([1.0, 0.0, 2.0]), jnp.array([0.5, -1.0, 0.0])
    out, t = jax.jvp(fp, (X, V), (tx, tv))
    out_r, t_r = jax.jvp(f_of_h, (X, V), (tx, tv))
    close((out, t), (out_r, t_r))
    y, vjp = jax.vjp(fp, X, V)
    close(vjp(jnp.float32(1.0)), jax.grad(f_of_h, argnums=(0, 1))(X, V))


def test_grad_of_reaped_value_and_of_harvest():
    # d(sum h)/dx with h = sin(x) * x
    g = jax.grad(lambda x: jnp.sum(reap(f)(x)["h"]))(X)
    close(g, jnp.cos(X) * X + jnp.sin(X))

    # harvest: grad of out w.r.t. planted value, with another name reaped
    def f2(x):
        a = sow(x * 2.0, name="a", mode="strict")
        b = sow(jnp.sin(a), name="b", mode="strict")
        return jnp.sum(b * a)

    def both(v):
        out, r = harvest(f2)({"a": v}, X)
        return out + jnp.sum(r["b"])

    close(jax.grad(both)(V), jnp.cos(V) * V + jnp.sin(V) + jnp.cos(V))


def test_grad_of_call_and_reap_output_equals_grad_of_f():
    close(jax.grad(lambda x: call_and_reap(f)(x)[0])(X), jax.grad(f)(X))
    close(jax.jit(jax.grad(lambda x: call_and_reap(f)(x)[0]))(X), jax.grad(f)(X))


# ---------------------------------------------------------------------------
# Harvesting differentiated functions


def test_reap_of_grad_sees_forward_sows_once():
    def g(x):
        h = sow(jnp.sin(x), name="h", mode="collect")
        return jnp.sum(h * h)

    grad, r = call_and_reap(jax.grad(g))(X)
    close(grad, 2 * jnp.sin(X) * jnp.cos(X))
    close(r, {"h": (jnp.sin(X),)})

    # strict sites are fine under grad, value_and_grad, jvp and vjp
    def s(x):
        return jnp.sum(sow(jnp.sin(x), name="h", mode="strict") ** 2)

    close(reap(jax.grad(s))(X), {"h": jnp.sin(X)})
    close(reap(jax.value_and_grad(s))(X), {"h": jnp.sin(X)})
    close(reap(lambda x: jax.jvp(s, (x,), (jnp.ones(3),)))(X), {"h": jnp.sin(X)})
    close(reap(lambda x: jax.vjp(s, x)[1](1.0))(X), {"h": jnp.sin(X)})
    close(reap(jax.jacrev(s))(X), {"h": jnp.sin(X)})


def test_reap_of_jacfwd_and_hessian():
    # jacfwd = vmap over tangents of jvp: the primal sow is not batched.
    def s(x):
        return jnp.sum(sow(jnp.sin(x), name="h", mode="strict") ** 2)

    close(reap(jax.jacfwd(s))(X), {"h": jnp.sin(X)})
    close(reap(jax.hessian(s))(X), {"h": jnp.sin(X)})


def test_bare_unused_sow_in_scan_under_grad_is_reaped():
    def loss(x):
        def body(c, xi):
            sow(xi * 3.0, name="unused", mode="append")
            return c + xi**2, None

        return lax.scan(body, 0.0, x)[0]

    g, r = call_and_reap(jax.grad(loss))(X)
    close(g, 2 * X)
    close(r, {"unused": X * 3.0})


def test_scan_under_grad_collect_reaped_once():
    def loss(x):
        def body(c, xi):
            h = sow(jnp.tanh(c + xi), name="h", mode="collect")
            return h, None

        return lax.scan(body, 0.0, x)[0]

    c, hs = 0.0, []
    for xi in X:
        c = jnp.tanh(c + xi)
        hs.append(c)
    g, r = call_and_reap(jax.grad(loss))(X)
    close(r, {"h": (jnp.stack(hs),)})

    def ref(x):
        c = 0.0
        for i in range(3):
            c = jnp.tanh(c + x[i])
        return c

    close(g, jax.grad(ref)(X))


# ---------------------------------------------------------------------------
# custom_jvp / custom_vjp


@jax.custom_jvp
def log1pexp(x):
    e = sow(jnp.exp(x), name="exp", mode="strict")
    return jnp.log(1.0 + e)


@log1pexp.defjvp
def _log1pexp_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return log1pexp(x), (1.0 - 1.0 / (1.0 + jnp.exp(x))) * t


def test_custom_jvp_log1pexp_stable_grad_through_call_and_reap():
    x = jnp.float32(100.0)
    out, r = call_and_reap(log1pexp)(x)
    close(r, {"exp": jnp.exp(x)})
    g = jax.grad(lambda x: call_and_reap(log1pexp)(x)[0])(x)
    assert not jnp.isnan(g)
    close(g, jnp.float32(1.0))
    # and under grad-inside-reap too
    g2, r2 = call_and_reap(jax.grad(log1pexp))(x)
    close(g2, jnp.float32(1.0))
    close(r2, {"exp": jnp.exp(x)})
    # at a moderate point the reaped value and gradient match the formula
    x = jnp.float32(0.7)
    close(jax.grad(lambda x: call_and_reap(log1pexp)(x)[0])(x), jax.nn.sigmoid(x))
    close(jax.grad(lambda x: reap(log1pexp)(x)["exp"])(x), jnp.exp(x))


def test_custom_jvp_plant():
    x = jnp.float32(0.7)
    close(plant(log1pexp)({"exp": jnp.float32(3.0)}, x), jnp.log(4.0))
    # planted body is differentiated by ordinary autodiff w.r.t. the plant
    close(jax.grad(lambda e: plant(log1pexp)({"exp": e}, x))(jnp.float32(3.0)), 0.25)


# Sows in a custom_jvp's JVP rule run where JAX differentiates the call, as in oryx.


@jax.custom_jvp
def scaled_sin(x):
    return jnp.sin(x)


@scaled_sin.defjvp
def _scaled_sin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    scale = sow(jnp.cos(x) * 2.0, name="scale", mode="strict")  # only the rule sows it
    return scaled_sin(x), scale * t  # the rule calls the function: its body's sows would repeat


def test_custom_jvp_rule_sows_reaped_where_the_rule_runs():
    x, t = jnp.float32(0.7), jnp.float32(1.5)
    # Undifferentiated, JAX runs the body only: nothing to reap (as oryx).
    close(reap(scaled_sin)(x), {})
    (out, r), (out_dot, r_dot) = jax.jvp(call_and_reap(scaled_sin), (x,), (t,))
    close((out, out_dot), (jnp.sin(x), 2.0 * jnp.cos(x) * t))  # the rule's derivative, not cos
    close(r, {"scale": 2.0 * jnp.cos(x)})
    close(r_dot, {"scale": jnp.float32(0.0)})  # a value of the derivative, not differentiated
    # Reverse mode runs the rule too; the reaped value has no gradient.
    close(jax.grad(lambda x: call_and_reap(scaled_sin)(x)[0])(x), 2.0 * jnp.cos(x))
    close(jax.grad(lambda x: reap(scaled_sin)(x)["scale"])(x), jnp.float32(0.0))
    close(
        jax.vmap(lambda x: jax.jvp(reap(scaled_sin), (x,), (t,))[0])(X), {"scale": 2.0 * jnp.cos(X)}
    )
    # jvp taken inside: the rule is part of the traced program (reaped once, not twice).
    close(reap(lambda x: jax.jvp(scaled_sin, (x,), (t,)))(x), {"scale": 2.0 * jnp.cos(x)})
    # Inside a jit the walk sees no tangents, so the rule does not run there (as oryx).
    close(jax.jvp(jax.jit(reap(scaled_sin)), (x,), (t,))[0], {})
    close(
        jax.jit(lambda x: jax.jvp(reap(scaled_sin), (x,), (t,))[0])(x), {"scale": 2.0 * jnp.cos(x)}
    )


def test_custom_jvp_rule_sows_planted_where_the_rule_runs():
    x, t = jnp.float32(0.7), jnp.float32(1.5)
    # Undifferentiated: the body runs, the rule is never traced, so the name
    # has no site to land on (an error, not a plant silently dropped).
    with pytest.raises(KeyError, match="Cannot plant 'scale'"):
        plant(scaled_sin)({"scale": jnp.float32(5.0)}, x)
    out, out_dot = jax.jvp(
        plant(scaled_sin), ({"scale": jnp.float32(5.0)}, x), ({"scale": jnp.float32(9.0)}, t)
    )
    close((out, out_dot), (jnp.sin(x), 5.0 * t))  # the planted tangent (9.0) is ignored, as in oryx
    close(
        jax.grad(lambda x: plant(scaled_sin)({"scale": jnp.float32(5.0)}, x))(x), jnp.float32(5.0)
    )


def _untraceable_rule(kind):
    """A custom_jvp whose body sows, and whose rule JAX must not trace unless it
    differentiates: one that raises, or one that calls back into Python."""

    @jax.custom_jvp
    def g(x):
        return sow(jnp.sin(x), name="s", mode="strict") * 2.0

    @g.defjvp
    def _g_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        if kind == "raises":
            raise RuntimeError("this rule runs only under differentiation")
        cos = jax.pure_callback(
            lambda a: np.cos(a).astype(np.float32), jax.ShapeDtypeStruct((), jnp.float32), x
        )
        return g(x), 2.0 * cos * t

    return g


@pytest.mark.parametrize("kind", ["raises", "pure_callback"])
def test_custom_jvp_rule_is_not_traced_where_nothing_differentiates(kind):
    g = _untraceable_rule(kind)
    x = jnp.float32(0.7)
    close(jax.jit(g)(x), 2.0 * jnp.sin(x))  # JAX runs it: so must reap and plant
    out, reaped = call_and_reap(g)(x)
    close((out, reaped), (2.0 * jnp.sin(x), {"s": jnp.sin(x)}))
    close(jax.jit(reap(g))(x), {"s": jnp.sin(x)})
    close(plant(g)({"s": jnp.float32(3.0)}, x), jnp.float32(6.0))
    close(reap(jax.vmap(g))(X), {"s": jnp.sin(X)})
    if kind == "pure_callback":  # differentiated, the rule runs, as under jax.grad(g)
        close(jax.grad(lambda x: call_and_reap(g)(x)[0])(x), jax.grad(g)(x))
    else:
        with pytest.raises(RuntimeError, match="runs only under differentiation"):
            jax.grad(g)(x)
        with pytest.raises(RuntimeError, match="runs only under differentiation"):
            jax.grad(lambda x: call_and_reap(g)(x)[0])(x)


def _rule_never_calls_the_body(kind):
    """A custom derivative whose rule computes the primal itself: differentiated,
    JAX never runs the body, where the sow is."""
    if kind == "jvp":

        @jax.custom_jvp
        def g(x):
            return sow(jnp.sin(x), name="s", mode="strict") * 2.0

        @g.defjvp
        def _g_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            return 2.0 * jnp.sin(x), 2.0 * jnp.cos(x) * t

        return g

    @jax.custom_vjp
    def v(x):
        return sow(jnp.sin(x), name="s", mode="strict") * 2.0

    v.defvjp(lambda x: (2.0 * jnp.sin(x), x), lambda x, ct: (2.0 * jnp.cos(x) * ct,))
    return v


@pytest.mark.parametrize("kind", ["jvp", "vjp"])
def test_body_sows_of_a_custom_rule_differentiated_inside_are_reaped_on_the_primal(kind):
    # By hand: the body sows sin(x) where f runs at x; a grad inside the
    # harvested function runs the rule instead, but the value is still sin(x).
    g = _rule_never_calls_the_body(kind)
    x = jnp.float32(0.5)
    grad, reaped = call_and_reap(jax.grad(g))(x)
    close((grad, reaped), (2.0 * jnp.cos(x), {"s": jnp.sin(x)}))
    (value, grad), reaped = call_and_reap(jax.value_and_grad(g))(x)
    close((value, grad, reaped), (2.0 * jnp.sin(x), 2.0 * jnp.cos(x), {"s": jnp.sin(x)}))
    close(jax.jit(reap(jax.grad(g)))(x), {"s": jnp.sin(x)})
    close(reap(jax.vmap(jax.grad(g)))(X), {"s": jnp.sin(X)})
    if kind == "jvp":
        close(reap(lambda x: jax.jvp(g, (x,), (1.0,)))(x), {"s": jnp.sin(x)})
    # Planting there could change nothing the rule computes: an error, not ignored.
    with pytest.raises(ValueError, match=r"name='s'.*rule.*instead of its body"):
        plant(jax.grad(g))({"s": jnp.float32(3.0)}, x)
    # A rule that calls the body sows its names itself: reaped once, not twice.
    g2, r2 = call_and_reap(jax.grad(log1pexp))(jnp.float32(0.7))
    close((g2, r2), (jax.nn.sigmoid(jnp.float32(0.7)), {"exp": jnp.exp(jnp.float32(0.7))}))


def test_custom_jvp_sowing_in_body_and_rule_is_a_clear_error_when_differentiated():
    @jax.custom_jvp
    def g(x):
        return sow(x * 2.0, name="body", mode="strict")

    @g.defjvp
    def _g_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return x * 2.0, sow(t, name="rule", mode="strict") * 2.0

    close(reap(g)(1.0), {"body": 2.0})
    with pytest.raises(
        ValueError, match="name='rule'.*JVP rule.*also sows.*body.*Sow in one of the two"
    ):
        jax.jvp(reap(g), (1.0,), (1.0,))


@jax.custom_vjp
def clip_grad_sq(x):
    h = sow(x * x, name="sq", mode="strict")
    return h + 1.0


def _cgs_fwd(x):
    return clip_grad_sq(x), x


def _cgs_bwd(x, g):
    # deliberately not the true derivative: clipped
    return (jnp.clip(2.0 * x * g, -1.0, 1.0),)


clip_grad_sq.defvjp(_cgs_fwd, _cgs_bwd)


def test_custom_vjp_reap_plant_and_rule_kept():
    out, r = call_and_reap(clip_grad_sq)(X)
    close(out, X * X + 1.0)
    close(r, {"sq": X * X})
    loss = lambda x: jnp.sum(clip_grad_sq(x))
    expect = jnp.clip(2.0 * X, -1.0, 1.0)
    close(jax.grad(loss)(X), expect)
    # the custom rule survives reaping
    close(jax.grad(lambda x: jnp.sum(call_and_reap(clip_grad_sq)(x)[0]))(X), expect)
    g, r = call_and_reap(jax.grad(loss))(X)
    close(g, expect)
    close(r, {"sq": X * X})
    # planting
    close(plant(clip_grad_sq)({"sq": V}, X), V + 1.0)
    close(jax.grad(lambda v: jnp.sum(plant(clip_grad_sq)({"sq": v}, X)))(V), jnp.ones(3))


class _SqHi(VJPHiPrimitive):
    def __init__(self, x_aval):
        self.in_avals = (x_aval,)
        self.out_aval = x_aval
        self.params = {}
        super().__init__()

    def expand(self, x):
        return x**2

    def vjp_fwd(self, *args):
        x = args[-1]  # newer JAX passes which inputs are nonzero first (nzs_in); 0.8 does not
        return self(x), x

    def vjp_bwd_retval(self, x, g):
        gx = 2.0 * x * g
        sow(gx, name="hi_retval", mode="strict")
        return (gx,)


class _SqHiAccum(_SqHi):
    vjp_bwd_retval = VJPHiPrimitive.vjp_bwd_retval

    def vjp_bwd(self, x, g, x_acc):
        gx = 2.0 * x * g
        sow(gx, name="hi_accum", mode="strict")
        x_acc.accum(gx)


@pytest.mark.parametrize("cls,name", [(_SqHi, "hi_retval"), (_SqHiAccum, "hi_accum")])
def test_hijax_backward_rule_sow_is_reaped(cls, name):
    def loss(x):
        return jnp.sum(cls(jax.typeof(x))(x) * 3.0)

    x = jnp.array([1.0, 2.0])
    g, r = call_and_reap(jax.grad(loss))(x)
    close(g, 6.0 * x)
    close(r, {name: 6.0 * x})


# ---------------------------------------------------------------------------
# perturb


def mlp_loss(x):
    h = perturb(jnp.tanh(x * 2.0), name="g_h")
    return jnp.sum(h**2 * X)


def mlp_loss_ref(x, eps):
    h = jnp.tanh(x * 2.0) + eps
    return jnp.sum(h**2 * X)


def dloss_dh(x):
    return jax.grad(mlp_loss_ref, argnums=1)(x, jnp.zeros(3))


def test_perturb_is_identity_and_keeps_gradient():
    close(perturb(X, name="p"), X)
    close(jax.jit(lambda x: perturb(x, name="p"))(X), X)
    close(mlp_loss(X), mlp_loss_ref(X, 0.0))
    close(jax.grad(mlp_loss)(X), jax.grad(mlp_loss_ref)(X, jnp.zeros(3)))
    g, r = call_and_reap(jax.grad(mlp_loss))(X)
    close(g, jax.grad(mlp_loss_ref)(X, jnp.zeros(3)))
    close(r, {"g_h": (dloss_dh(X),)})


def test_perturb_under_jit_and_vmap():
    close(reap(jax.jit(jax.grad(mlp_loss)))(X), {"g_h": (dloss_dh(X),)})
    close(jax.jit(reap(jax.grad(mlp_loss)))(X), {"g_h": (dloss_dh(X),)})
    xb = jnp.stack([X, -X * 0.5])
    expect = jnp.stack([dloss_dh(X), dloss_dh(-X * 0.5)])
    close(reap(jax.vmap(jax.grad(mlp_loss)))(xb), {"g_h": (expect,)})
    close(jax.vmap(reap(jax.grad(mlp_loss)))(xb), {"g_h": (expect,)})


def test_perturb_in_remat():
    loss = jax.checkpoint(mlp_loss, policy=jax.checkpoint_policies.nothing_saveable)
    g, r = call_and_reap(jax.grad(loss))(X)
    close(g, jax.grad(mlp_loss_ref)(X, jnp.zeros(3)))
    close(r, {"g_h": (dloss_dh(X),)})


def test_perturb_in_scan_one_cotangent_per_iteration_aligned():
    def loss(xs):
        def body(c, x):
            h = perturb(jnp.sin(c * x + x), name="g")
            return h, h * 2.0

        c, ys = lax.scan(body, jnp.float32(0.5), xs)
        return c + jnp.sum(ys * jnp.arange(1.0, 4.0))

    def ref(xs, eps):
        c, ys = jnp.float32(0.5), []
        for i in range(3):
            c = jnp.sin(c * xs[i] + xs[i]) + eps[i]
            ys.append(c * 2.0)
        return c + jnp.sum(jnp.stack(ys) * jnp.arange(1.0, 4.0))

    g, r = call_and_reap(jax.grad(loss))(X)
    close(g, jax.grad(ref)(X, jnp.zeros(3)))
    close(r, {"g": (jax.grad(ref, argnums=1)(X, jnp.zeros(3)),)})


def test_perturb_in_reverse_scan_aligned_with_forward_iterations():
    def loss(xs):
        def body(c, x):
            h = perturb(c * x + 1.0, name="g")
            return h, None

        return lax.scan(body, jnp.float32(1.0), xs, reverse=True)[0]

    def ref(xs, eps):
        c = jnp.float32(1.0)
        for i in (2, 1, 0):
            c = c * xs[i] + 1.0 + eps[i]
        return c

    close(reap(jax.grad(loss))(X), {"g": (jax.grad(ref, argnums=1)(X, jnp.zeros(3)),)})


def test_perturb_in_cond():
    def loss(x, p):
        h = lax.cond(p, lambda x: perturb(x * 3.0, name="g"), lambda x: x * 5.0, x)
        return jnp.sum(h**2)

    g, r = call_and_reap(jax.grad(loss))(X, jnp.bool_(True))
    close(g, 18.0 * X)
    close(r, {"g": (2.0 * 3.0 * X,)})  # d sum(h^2)/dh = 2h, h = 3x
    g, r = call_and_reap(jax.grad(loss))(X, jnp.bool_(False))
    close(g, 50.0 * X)
    close(r, {"g": (jnp.zeros(3),)})


def test_value_and_grad_sow_and_perturb_two_tags_one_pass():
    def loss(x):
        h = jnp.tanh(x * 2.0)
        h = sow(h, name="h", tag="acts")
        h = perturb(h, name="h", tag="grads")
        return jnp.sum(h**2 * X)

    ((val, grad), acts), grads = call_and_reap(
        call_and_reap(jax.value_and_grad(loss), tag="acts"), tag="grads"
    )(X)
    close(val, mlp_loss_ref(X, 0.0))
    close(grad, jax.grad(mlp_loss_ref)(X, jnp.zeros(3)))
    close(acts, {"h": (jnp.tanh(X * 2.0),)})
    close(grads, {"h": (dloss_dh(X),)})
    # each tag alone
    (vg, a) = call_and_reap(jax.value_and_grad(loss), tag="acts")(X)
    close(a, {"h": (jnp.tanh(X * 2.0),)})
    (vg, gr) = call_and_reap(jax.value_and_grad(loss), tag="grads")(X)
    close(gr, {"h": (dloss_dh(X),)})


@jax.custom_vjp
def _looped(y):
    body = lambda c: (c[0] + 1, sow(c[1] * y, name="h", mode="clobber"))
    return lax.while_loop(lambda c: c[0] < 3, body, (0, y))[1]


_looped.defvjp(lambda y: (_looped(y), y), lambda y, ct: (7.0 * ct,))


def test_grad_of_output_through_custom_vjp_whose_body_loops():
    # The reaped value has no cotangent, so only the user's rule runs: the
    # body's while_loop (which has no VJP) is never differentiated.
    out, reaped = call_and_reap(_looped)(1.5)
    close(out, _looped(1.5))
    close(reaped["h"], jnp.float32(1.5**4))  # y, then three multiplications by y
    close(jax.grad(lambda y: call_and_reap(_looped)(y)[0])(1.5), jax.grad(_looped)(1.5))
    close(jax.grad(lambda y: call_and_reap(_looped)(y)[0])(1.5), jnp.float32(7.0))
    close(
        jax.value_and_grad(lambda y: call_and_reap(_looped)(y)[0])(2.0),
        (_looped(2.0), jnp.float32(7.0)),
    )


def test_grad_of_odeint_with_a_sow_in_the_vector_field():
    from jax.experimental.ode import odeint

    def decay(y0, k):
        field = lambda y, t, k: -k * sow(y, name="y", mode="clobber")
        return odeint(field, y0, jnp.array([0.0, 1.0]), k)[-1]

    grad_k = jax.grad(lambda k: call_and_reap(decay)(1.0, k)[0])(0.5)
    close(grad_k, jax.grad(decay, argnums=1)(1.0, 0.5))
    np.testing.assert_allclose(grad_k, -np.exp(-0.5), rtol=1e-4)  # d/dk exp(-k) at k = 0.5
    out, reaped = jax.jit(call_and_reap(decay))(1.0, 0.5)
    close(out, decay(1.0, 0.5))
    assert reaped["y"].shape == ()


def test_grad_of_a_plant_inside_odeint_is_the_hand_threaded_adjoint():
    # odeint's adjoint rule re-runs the vector field; harvest re-runs it with
    # the plant in place, so the rule differentiates the planted field. The
    # truth: odeint with the planted value written into the field.
    from jax.experimental.ode import odeint

    ts = jnp.array([0.0, 1.0])

    def decay(y0, k):
        return odeint(lambda y, t, k: -k * sow(y, name="y", mode="clobber"), y0, ts, k)[-1]

    def by_hand(k):
        return odeint(lambda y, t, k: -k * (y * 0.5), 1.0, ts, k)[-1]

    planted = lambda k: plant(decay)({"y": lambda y: y * 0.5}, 1.0, k)  # noqa: E731
    close(planted(0.5), by_hand(0.5))
    np.testing.assert_allclose(jax.grad(by_hand)(0.5), -0.5 * np.exp(-0.25), rtol=1e-4)
    for grad in (jax.grad(planted), jax.jit(jax.grad(planted))):
        np.testing.assert_allclose(grad(0.5), jax.grad(by_hand)(0.5), rtol=1e-5)


def _rated(k):
    from jax.experimental.ode import odeint

    field = lambda y, t, k: -sow(k * 2.0, name="rate", mode="clobber") * k * y  # noqa: E731
    return odeint(field, 1.0, jnp.array([0.0, 1.0]), k)[-1]


def _rated_by_hand(k, rate):
    from jax.experimental.ode import odeint

    return odeint(lambda y, t, k: -rate(k) * k * y, 1.0, jnp.array([0.0, 1.0]), k)[-1]


def test_grad_of_a_plant_inside_odeint_of_a_number_or_a_callable_and_under_harvest():
    by_hand = jax.grad(lambda k: _rated_by_hand(k, lambda k: 3.0))(0.5)
    number = jax.grad(lambda k: plant(_rated)({"rate": 3.0}, k))(0.5)  # traced as data
    np.testing.assert_allclose(number, by_hand, rtol=1e-5)
    both = jax.grad(lambda k: harvest(_rated)({"rate": 3.0}, k)[0])(0.5)
    np.testing.assert_allclose(both, by_hand, rtol=1e-5)
    squared = jax.grad(lambda k: plant(_rated)({"rate": lambda r: r * r}, k))(0.5)
    by_hand = jax.grad(lambda k: _rated_by_hand(k, lambda k: (2.0 * k) ** 2))(0.5)
    np.testing.assert_allclose(squared, by_hand, rtol=1e-5)


def test_grad_inside_odeint_is_refused_where_the_adjoint_cannot_hold_the_plant():
    # The planted value differentiated: odeint's rule gives no cotangent for it.
    with pytest.raises(ValueError, match=r"'_odeint'.*itself differentiated.*name='rate'"):
        jax.grad(lambda c: plant(_rated)({"rate": c}, 0.5))(3.0)
    # A plant by occurrence index: the rule's occurrences are not the body's.
    by_index = {"rate": lambda r, i: r * 0.0 + 3.0}
    with pytest.raises(ValueError, match=r"'_odeint'.*per occurrence.*name='rate'"):
        jax.grad(lambda k: plant(_rated)(by_index, k))(0.5)


def test_a_scan_in_a_differentiated_custom_jvp_body_shows_only_the_sows_its_rule_lacks():
    @jax.custom_jvp
    def g(x):
        def body(c, _):
            sow(c, name="inner", mode="append")
            sow(c * 2.0, name="both", mode="append")
            return c * 2.0, None

        return jax.lax.scan(body, x, None, length=3)[0]

    @g.defjvp
    def g_jvp(primals, tangents):
        (x,), (dx,) = primals, tangents
        sow(x * 2.0, name="both", mode="append")
        return x * 8.0, dx * 8.0

    reaped = reap(jax.grad(g))(1.0)
    np.testing.assert_allclose(reaped["inner"], [1.0, 2.0, 4.0])
    np.testing.assert_allclose(reaped["both"], [2.0])  # the rule's alone
    with pytest.raises(ValueError, match="Cannot plant.*'inner'.*custom_jvp or custom_vjp"):
        plant(jax.grad(g))({"inner": jnp.zeros(3)}, 1.0)
