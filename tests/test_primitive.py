"""sow_p as a JAX primitive: an identity under every transformation, that survives DCE."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TRANSCENDENTAL_RTOL, close
from jax.experimental import jet

from harvest import call_and_reap, plant, reap, sow, sow_cond, sow_p


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pair:
    a: jax.Array
    b: jax.Array


X = jnp.array([0.5, -1.0, 2.0], jnp.float32)


@pytest.mark.parametrize(
    "value",
    [
        X,
        {"u": X, "v": (X * 2, jnp.int32(3))},
        (X, X + 1),
        Pair(X, X * 3),
        1.5,
        3,
        np.float32(2.0),
    ],
    ids=["array", "dict", "tuple", "dataclass", "float", "int", "npscalar"],
)
@pytest.mark.parametrize("mode", ["collect", "strict", "append", "clobber"])
def test_sow_is_identity_eagerly(value, mode):
    out = sow(value, name="v", mode=mode)
    close(out, value)


def test_sow_is_identity_under_jit_vmap_grad():
    def f(x):
        h = sow(jnp.sin(x), name="h")
        d = sow({"p": h * 2.0, "q": h + 1.0}, name="d", mode="append")
        return jnp.sum(d["p"] * d["q"])

    def ref(x):
        h = jnp.sin(x)
        return jnp.sum(2.0 * h * (h + 1.0))

    close(jax.jit(f)(X), ref(X))
    close(jax.vmap(f)(jnp.stack([X, -X])), jnp.stack([ref(X), ref(-X)]))
    close(jax.grad(f)(X), jnp.cos(X) * (4.0 * jnp.sin(X) + 2.0))
    close(jax.grad(f)(X), jax.grad(ref)(X))
    p, t = jax.jvp(f, (X,), (jnp.ones_like(X),))
    p_ref, t_ref = jax.jvp(ref, (X,), (jnp.ones_like(X),))
    close((p, t), (p_ref, t_ref))
    y, vjp = jax.vjp(f, X)
    close(vjp(jnp.float32(1.0))[0], jax.grad(ref)(X))
    close(jax.jit(jax.vmap(jax.grad(f)))(jnp.stack([X, X])), jnp.stack([jax.grad(ref)(X)] * 2))


def test_sow_cond_is_identity():
    def f(x):
        return sow_cond(x * 2.0, jnp.sum(x) > 0, name="c") + 1.0

    close(f(X), X * 2 + 1)
    close(jax.jit(f)(X), X * 2 + 1)
    close(jax.grad(lambda x: jnp.sum(f(x)))(X), 2.0 * jnp.ones_like(X))
    close(jax.vmap(f)(jnp.stack([X, -X])), jnp.stack([X * 2 + 1, -X * 2 + 1]))


def test_jaxpr_holds_sow_with_params():
    def f(x):
        return sow(x + 1.0, name="h", tag="mytag", mode="append") * 2.0

    jaxpr = jax.make_jaxpr(f)(X)
    eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive is sow_p]
    assert len(eqns) == 1
    p = eqns[0].params
    assert p["name"] == "h" and p["tag"] == "mytag" and p["mode"] == "append"


def test_bare_unused_sow_survives_dce_and_jit():
    def f(x):
        sow(x * 5.0, name="unused", mode="strict")
        return x + 1.0

    # A plain jit still computes the function and keeps the marker.
    close(jax.jit(f)(X), X + 1.0)
    jaxpr = jax.make_jaxpr(jax.jit(f))(X)
    inner = jaxpr.jaxpr.eqns[0].params["jaxpr"].jaxpr
    assert any(e.primitive is sow_p for e in inner.eqns)
    # And reap sees it.
    close(reap(f)(X), {"unused": X * 5.0})
    close(reap(jax.jit(f))(X), {"unused": X * 5.0})


def test_bare_sow_survives_grad_partial_eval():
    # The sow's value is unused by the output; grad partial-evaluates f, which
    # must not drop the marker.
    def f(x):
        sow(jnp.cos(x), name="c", mode="strict")
        return jnp.sum(x**2)

    g, r = reap_and_call(jax.grad(f), X)
    close(g, 2 * X)
    close(r, {"c": jnp.cos(X)})


def reap_and_call(f, *args):
    from harvest import call_and_reap

    return call_and_reap(f)(*args)


def test_jvp_tangent_passes_through_sow():
    def f(x):
        return sow(x * 3.0, name="t", mode="strict") ** 2

    p, t = jax.jvp(f, (X,), (jnp.full_like(X, 2.0),))
    close(p, (3 * X) ** 2)
    close(t, 2 * (3 * X) * 3 * 2.0)


def test_lowering_is_identity_in_hlo():
    def f(x):
        return sow(x, name="i", mode="strict")

    compiled = jax.jit(f).lower(X).compile()
    close(compiled(X), X)


def test_sow_dtype_preserved():
    for v in [
        jnp.int32(4),
        jnp.arange(3, dtype=jnp.int16),
        jnp.array([True, False]),
        jnp.float16(1.0),
    ]:
        out = jax.jit(lambda v: sow(v, name="x", mode="strict"))(v)
        assert out.dtype == v.dtype
        close(out, v)


def test_jacfwd_and_hessian_of_sowing_function():
    # jacfwd vmaps a jvp whose primal output is unbatched; the sow must not
    # make an unbatched value batched.
    def f(x):
        return jnp.sum(sow(jnp.sin(x), name="h") ** 2)

    def ref(x):
        return jnp.sum(jnp.sin(x) ** 2)

    close(jax.jacfwd(f)(X), jax.jacfwd(ref)(X))
    close(jax.hessian(f)(X), jax.hessian(ref)(X))


def test_vmap_out_axes_none_for_unbatched_sown_value():
    def f(x, y):
        return x * 2.0, sow(y, name="c") + 1.0

    out = jax.vmap(f, in_axes=(0, None), out_axes=(0, None))(X, jnp.float32(1.0))
    close(out, (X * 2.0, jnp.float32(2.0)))


# ---------------------------------------------------------------------------
# A bare sow (result unused) reaches the harvest through every transformation,
# exactly once, yet outside a harvest the program carries no effect.


def _bare(x):
    sow(jnp.cos(x), name="s", mode="append")


def _custom_vjp_body():
    @jax.custom_vjp
    def g(y):
        _bare(y)
        return jnp.sin(y)

    g.defvjp(lambda y: (g(y), y), lambda y, ct: (ct * jnp.cos(y),))
    return g


def _custom_jvp_body():
    @jax.custom_jvp
    def g(y):
        _bare(y)
        return jnp.sin(y)

    g.defjvp(lambda p, t: (g(p[0]), jnp.cos(p[0]) * t[0]))
    return g


def _scan_of(step):
    return lambda x: jax.lax.scan(lambda c, xi: (c + step(xi), None), 0.0, x)[0]


def _then_sin(step):
    # `step(x)` runs for its sows only; the output does not depend on it.
    return lambda x: (step(x), jnp.sum(jnp.sin(x)))[1]


# name -> f(x) whose sows reap to {"s": cos(X)} (one append row per element in a
# scan, one row of 3 elsewhere); each sow's value is unused.
BARE = {
    "top": _then_sin(_bare),
    "jit": _then_sin(jax.jit(_bare)),
    "scan": _scan_of(lambda xi: (_bare(xi), jnp.sin(xi))[1]),
    "scan_of_jit": _scan_of(lambda xi: (jax.jit(_bare)(xi), jnp.sin(xi))[1]),
    "scan_of_cond": _scan_of(
        lambda xi: (jax.lax.cond(xi > -5.0, _bare, lambda v: None, xi), jnp.sin(xi))[1]
    ),
    "scan_of_remat": _scan_of(lambda xi: (jax.checkpoint(_bare)(xi), jnp.sin(xi))[1]),
    "remat": jax.checkpoint(_then_sin(_bare)),
    "remat_of_jit": jax.checkpoint(_then_sin(jax.jit(_bare))),
    "remat_of_scan": jax.checkpoint(_then_sin(_scan_of(lambda xi: (_bare(xi), 0.0)[1]))),
    "remat_used": jax.checkpoint(
        lambda x: jnp.sum(jnp.sin(jnp.arccos(sow(jnp.cos(x), name="s", mode="append"))))
    ),
    "cond": lambda x: jnp.sum(
        jax.lax.cond(x[0] < 5.0, lambda y: (_bare(y), jnp.sin(y))[1], jnp.sin, x)
    ),
    "custom_vjp": lambda x: jnp.sum(_custom_vjp_body()(x)),
    "custom_jvp": lambda x: jnp.sum(_custom_jvp_body()(x)),
}

WRAPPERS = {
    "plain": lambda f: f,
    "grad": jax.grad,
    "jit_of_grad": lambda f: jax.jit(jax.grad(f)),
    "grad_of_jit": lambda f: jax.grad(jax.jit(f)),
    "grad_of_remat": lambda f: jax.grad(jax.checkpoint(f)),
    "linearize": lambda f: lambda x: jax.linearize(f, x)[1](x),
    "vmap_of_grad": lambda f: lambda x: jax.vmap(jax.grad(f), in_axes=None, axis_size=2)(x),
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("case", sorted(BARE))
def test_bare_sow_reaped_once_through_transformations(case, wrapper, request):
    g = WRAPPERS[wrapper](BARE[case])
    if wrapper == "linearize" and case == "custom_vjp":
        # JAX itself refuses forward mode through a custom_vjp; harvest must not hide that.
        with pytest.raises(TypeError, match="forward-mode autodiff"):
            reap(g)(X)
        return
    if wrapper == "grad_of_remat" and case == "scan_of_remat":
        # JAX's partial evaluation of the outer checkpoint drops the inner one,
        # which has no outputs (a sow's effect does not keep it either).
        # Strict: the test still runs, and passes loudly once JAX keeps the sow.
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                reason="a bare sow in an output-less checkpoint in a scan in a checkpoint, under grad",
            )
        )
    want = reap(jax.jit(BARE[case]))(X)  # the sow without any transformation in between
    close(jnp.ravel(want["s"]), jnp.cos(X))
    close(reap(g)(X), want)


@pytest.mark.parametrize("wrapper", ["plain", "grad", "grad_of_remat"])
@pytest.mark.parametrize("case", ["jit", "scan", "remat_of_scan", "cond"])
def test_jit_traced_outside_a_harvest_keeps_its_sows_inside_one(case, wrapper):
    # Outside a harvest the bare sow carries no effect, so JAX may drop it when it
    # traces; the same jit called inside reap must be traced again, keeping it.
    jitted = jax.jit(WRAPPERS[wrapper](BARE[case]))
    out = jitted(X)
    close(jnp.ravel(reap(jitted)(X)["s"]), jnp.cos(X))
    close(jitted(X), out)


def test_sowing_program_has_no_effect_outside_a_harvest():
    def f(x):
        a = sow(x * 2.0, name="a")
        _bare(a)
        c = jax.lax.scan(lambda c, xi: (c + sow(xi, name="b"), None), 0.0, a)[0]
        return jax.jit(lambda y: sow(y, name="c"))(c)

    def plain(x):
        return jax.jit(lambda y: y)(jax.lax.scan(lambda c, xi: (c + xi, None), 0.0, x * 2.0)[0])

    reap(f)(X)  # a harvest before and after must leave no trace on plain programs
    assert jax.make_jaxpr(f)(X).effects == set()
    assert jax.make_jaxpr(jax.grad(f))(X).effects == set()
    text = jax.jit(f).lower(X).as_text()
    assert "token" not in text
    strip = lambda t: "\n".join(l for l in t.splitlines() if not l.startswith("#loc"))  # noqa: E731
    assert len(strip(text).splitlines()) == len(
        strip(jax.jit(plain).lower(X).as_text()).splitlines()
    )
    close(reap(f)(X)["s"], jnp.cos(X * 2.0)[None])


# ---------------------------------------------------------------------------
# Outside a harvest a sow is the identity for every JAX transformation; inside
# one, its value is still read and replaced.


def _lin(x):
    return 2.0 * sow(x * 3.0, name="s")


def _nonlin(x):
    return jnp.sin(sow(x * 3.0, name="s")) * x


def _nonlin_plain(x):
    return jnp.sin(x * 3.0) * x


C = jnp.array([1.0, -2.0, 0.25], jnp.float32)


def test_linear_transpose_passes_cotangents_through_sow():
    (xbar,) = jax.linear_transpose(_lin, X)(C)
    close(xbar, 6.0 * C)

    # sow_cond's predicate is no linear input, and a bare sow transposes too.
    def f(x):
        sow(x, name="bare")
        return sow_cond(x * 3.0, X[0] > 0.0, name="c") * 2.0

    close(jax.linear_transpose(f, X)(C), (6.0 * C,))


def test_linear_transpose_inside_a_harvest_sees_the_cotangent():
    # The transposed function computes no forward value; what flows through the
    # site is the cotangent (2 * C here), so that is what is reaped and planted.
    transposed = lambda c: jax.linear_transpose(_lin, X)(c)[0]  # noqa: E731
    close(call_and_reap(transposed)(C), (6.0 * C, {"s": (2.0 * C,)}))
    close(jax.jit(reap(transposed))(C), {"s": (2.0 * C,)})
    close(plant(transposed)({"s": (C,)}, C), 3.0 * C)

    def bare(x):
        sow(x, name="bare")
        return 2.0 * x

    # No cotangent reaches a sow whose value is unused: it sows zeros.
    close(reap(lambda c: jax.linear_transpose(bare, X)(c))(C), {"bare": (jnp.zeros(3),)})


def test_jet_sows_the_primal_only():
    series = ([jnp.ones(3), C],)
    got = jet.jet(_nonlin, (X,), series)
    want = jet.jet(_nonlin_plain, (X,), series)
    close(got, want, rtol=TRANSCENDENTAL_RTOL)
    primal = lambda x: jet.jet(_nonlin, (x,), ([x, x],))  # noqa: E731
    out, reaped = call_and_reap(primal)(X)
    close(out, jet.jet(_nonlin_plain, (X,), ([X, X],)), rtol=TRANSCENDENTAL_RTOL)
    close(reaped, {"s": (3.0 * X,)})
    # As under grad, a plant replaces the primal only; the series flow on unchanged.
    planted = plant(primal)({"s": (C,)}, X)
    by_hand = jet.jet(lambda x, s: jnp.sin(s) * x, (X, C), ([X, X], [3.0 * X, 3.0 * X]))
    close(planted, by_hand, rtol=TRANSCENDENTAL_RTOL)


def test_export_round_trip():
    pytest.importorskip("flatbuffers")  # JAX's serialization needs it
    exported = jax.export.export(jax.jit(_nonlin))(X)
    assert not exported.ordered_effects and not exported.unordered_effects
    close(jax.export.deserialize(exported.serialize()).call(X), _nonlin_plain(X))
    # A harvested function exports like any other.
    harvested = jax.export.export(jax.jit(call_and_reap(_nonlin)))(X)
    close(
        jax.export.deserialize(harvested.serialize()).call(X), (_nonlin_plain(X), {"s": (3.0 * X,)})
    )


def test_checkify():
    from jax.experimental import checkify

    def f(x):
        checkify.check(jnp.all(x < 10.0), "x too large")
        return _nonlin(x)

    err, out = checkify.checkify(f)(X)
    assert err.get() is None
    close(out, _nonlin_plain(X))
    err, reaped = checkify.checkify(reap(f))(X)
    assert err.get() is None
    close(reaped, {"s": (3.0 * X,)})
    (err, out), reaped = call_and_reap(checkify.checkify(f))(X + 10.0)
    assert "x too large" in err.get()
    close(reaped, {"s": (3.0 * (X + 10.0),)})


def test_eval_shape():
    assert jax.eval_shape(_nonlin, X).shape == (3,)
    shapes = jax.eval_shape(reap(_nonlin), jax.ShapeDtypeStruct((5, 2), jnp.float32))
    assert jax.tree.map(lambda s: s.shape, shapes) == {"s": ((5, 2),)}


def test_aot_lower_and_compile():
    lowered = jax.jit(_nonlin).lower(X)
    assert "token" not in lowered.as_text()
    close(lowered.compile()(X), _nonlin_plain(X))
    compiled = jax.jit(reap(_nonlin)).lower(X).compile()
    close(compiled(X), {"s": (3.0 * X,)})
    close(jax.jit(plant(_nonlin)).lower({"s": (X,)}, X).compile()({"s": (C,)}, X), jnp.sin(C) * X)


def test_transpose_and_jet_of_a_vmapped_sow():
    # A sow bound under vmap carries its batching in its params; both rules keep them.
    xs = jnp.stack([X, 2.0 * X])
    f = jax.vmap(_lin)
    close(jax.linear_transpose(f, xs)(xs), (6.0 * xs,))
    close(reap(lambda c: jax.linear_transpose(f, xs)(c)[0])(xs), {"s": (2.0 * xs,)})
    g = jax.vmap(_nonlin)
    close(reap(lambda x: jet.jet(g, (x,), ([x, x],))[0])(xs), {"s": (3.0 * xs,)})
