"""harvest.extend: rules for primitives harvest did not know, and custom_vmap through it,
checked against the same functions without harvest."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.custom_batching import custom_vmap
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import batching

from harvest import call_and_reap, extend, patching_sweep, plant, reap, sites, sow

X = jnp.array([0.3, -1.2, 2.0])


def _with_rule(rule_sows: bool):
    """A custom_vmap function whose batching rule is not its body: +100 marks the rule's outputs."""

    @custom_vmap
    def f(x):
        return sow(jnp.sin(x), name="h", mode="strict") * 2.0

    @f.def_vmap
    def rule(axis_size, in_batched, x):
        h = sow(jnp.sin(x), name="h", mode="strict") if rule_sows else jnp.sin(x)
        return h * 2.0 + 100.0, True

    return f


def test_custom_vmap_sows_are_reaped_and_planted():
    f = _with_rule(rule_sows=False)
    out, reaped = call_and_reap(f)(0.5)
    np.testing.assert_allclose(out, f(0.5))
    np.testing.assert_allclose(reaped["h"], np.sin(0.5), rtol=1e-6)
    np.testing.assert_allclose(plant(f)({"h": 5.0}, 0.5), 10.0)
    assert [(s.name, s.fires, s.where) for s in sites(f)(0.5)] == [("h", 1, "custom_vmap")]


@pytest.mark.parametrize("rule_sows", [False, True])
def test_custom_vmap_under_vmap_keeps_the_rule_and_reaps_per_example(rule_sows):
    f = _with_rule(rule_sows)
    # The reference: the function without harvest, and reap inside the vmap.
    np.testing.assert_allclose(call_and_reap(jax.vmap(f))(X)[0], jax.vmap(f)(X))
    np.testing.assert_allclose(call_and_reap(jax.vmap(f))(X)[0], 2 * np.sin(X) + 100.0, rtol=1e-6)
    per_example = jax.vmap(reap(f))(X)
    np.testing.assert_allclose(per_example["h"], np.sin(X), rtol=1e-6)
    np.testing.assert_allclose(reap(jax.vmap(f))(X)["h"], per_example["h"], rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(call_and_reap(f))(X)[0], jax.vmap(f)(X))
    np.testing.assert_allclose(jax.vmap(lambda x: plant(f)({"h": 1.0}, x))(X), np.full(3, 2.0))


def test_planting_where_the_batching_rule_ran_instead_is_an_error():
    f = _with_rule(rule_sows=False)
    with pytest.raises(ValueError, match="batching rule instead of its body"):
        plant(jax.vmap(f))({"h": jnp.ones(3)}, X)
    # A rule that sows the name itself is planted there.
    g = _with_rule(rule_sows=True)
    np.testing.assert_allclose(plant(jax.vmap(g))({"h": jnp.ones(3)}, X), np.full(3, 102.0))


def test_a_sweep_inside_custom_vmap_matches_patching_by_hand():
    f = _with_rule(rule_sows=False)
    clean = reap(f)(0.5)
    result = patching_sweep(f, clean, (jnp.float32(-1.0),), lambda y: y)
    np.testing.assert_allclose(result.values, [2 * np.sin(0.5) - 2 * np.sin(-1.0)], rtol=1e-5)


def _twice_p() -> Primitive:
    twice_p = Primitive("twice_test")
    twice_p.multiple_results = True
    twice_p.def_impl(lambda x, *, body: jaxpr_as_fun(body)(*jaxpr_as_fun(body)(x)))
    twice_p.def_abstract_eval(lambda x, *, body: [x])
    return twice_p


def test_register_teaches_reap_plant_and_sites_a_new_primitive():
    twice_p = _twice_p()

    def twice(fn, x):
        return twice_p.bind(x, body=jax.make_jaxpr(fn)(x))[0]

    f = lambda x: twice(lambda y: sow(y * 3.0, name="h", mode="append"), x)  # noqa: E731
    with pytest.raises(NotImplementedError, match="twice_test"):
        reap(f)(1.0)

    def walk_twice(walk, eqn, invals):
        body = eqn.params["body"]
        once = extend.walk_in_place(walk, body.jaxpr, body.consts, invals)
        return extend.walk_in_place(walk, body.jaxpr, body.consts, once)

    bodies = lambda eqn: [extend.Body("twice", eqn.params["body"].jaxpr, runs=2)]  # noqa: E731
    extend.register(twice_p, extend.HigherOrder(bodies), walk_twice)
    np.testing.assert_allclose(reap(f)(1.0)["h"], [3.0, 9.0])
    np.testing.assert_allclose(plant(f)({"h": jnp.array([2.0, 5.0])}, 1.0), 5.0)
    assert [(s.fires, s.where) for s in sites(f)(1.0)] == [(2, "twice")]
    with pytest.raises(TypeError, match="HigherOrder"):
        extend.register(twice_p, bodies, walk_twice)


def test_custom_vmap_under_vmap_in_a_batched_branch_is_a_clear_error():
    # Its sows, shown where the batching rule ran, cannot leave a branch vmap
    # runs per example: reaping or planting them says so instead of a wrong number.
    f = _with_rule(rule_sows=False)
    g = jax.vmap(lambda x: jax.lax.cond(x > 0, f, jnp.cos, x))
    with pytest.raises(NotImplementedError, match="name='h'.*custom_vmap"):
        reap(g)(X)
    with pytest.raises(ValueError, match="batching rule instead of its body"):
        plant(g)({"h": jnp.ones(3)}, X)


def _call_like_p(name: str, call: bool) -> Primitive:
    """A call-like primitive (its body runs once on its inputs), registered with a
    rule that re-binds it; `call` says whether its descriptor declares it so."""
    call_p = Primitive(name)
    call_p.multiple_results = True
    call_p.def_impl(lambda *xs, body: jaxpr_as_fun(body)(*xs))
    call_p.def_abstract_eval(lambda *xs, body: body.out_avals)

    def batched(args, dims, *, body):  # the body vmapped, bound again
        run = jax.vmap(jaxpr_as_fun(body), in_axes=list(dims))
        outs = call_p.bind(*args, body=jax.make_jaxpr(run)(*args))
        return outs, [0] * len(outs)

    batching.primitive_batchers[call_p] = batched

    def rule(walk, eqn, invals):
        body = eqn.params["body"]
        return extend.retrace(walk, body.jaxpr, body.consts, invals).rebind(walk, eqn, "body")

    bodies = lambda eqn: [extend.Body(name, eqn.params["body"].jaxpr)]  # noqa: E731
    extend.register(call_p, extend.HigherOrder(bodies, rule=rule, call=call))
    return call_p


def _in_a_batched_cond(call_p):
    def inner(y):
        return jnp.sin(sow(y * 2.0, name="h", mode="clobber"))

    def f(x):
        sows = lambda x: call_p.bind(x, body=jax.make_jaxpr(inner)(x))[0]  # noqa: E731
        return jax.lax.cond(x > 0.0, sows, lambda x: x - 1.0, x)

    return jax.vmap(f)


def test_retrace_rebind_keeps_a_custom_call_and_matches_the_function():
    call_p = _call_like_p("rebound_call", call=True)
    f = lambda x: call_p.bind(x, body=jax.make_jaxpr(lambda y: sow(y * y, name="sq"))(x))[0]  # noqa: E731
    out, reaped = call_and_reap(f)(X)
    np.testing.assert_allclose(out, X * X)
    np.testing.assert_allclose(reaped["sq"][0], X * X)
    assert "rebound_call" in str(jax.make_jaxpr(reap(f))(X))
    np.testing.assert_allclose(plant(f)({"sq": (jnp.ones(3),)}, X), np.ones(3))


def test_a_custom_primitive_in_a_batched_cond_names_the_registration_that_fixes_it():
    xs = jnp.array([0.5, -1.0, 2.0])
    stuck = _in_a_batched_cond(_call_like_p("opaque_call", call=False))
    with pytest.raises(
        NotImplementedError,
        match=r"name='h'.*primitive `opaque_call`.*HigherOrder\(\.\.\., call=True\)",
    ):
        reap(stuck)(xs)
    # Declared call-like, harvest inlines it in the branch: reaped per example,
    # the taken branch's value (zeros where the other branch ran), as by hand.
    fixed = _in_a_batched_cond(_call_like_p("declared_call", call=True))
    out, reaped = call_and_reap(fixed)(xs)
    np.testing.assert_allclose(out, np.where(xs > 0, np.sin(2 * xs), xs - 1.0), rtol=1e-6)
    np.testing.assert_allclose(reaped["h"], np.where(xs > 0, 2 * xs, 0.0), rtol=1e-6)


def test_a_call_like_primitive_registered_without_a_rule_is_walked_in_place():
    call_p = Primitive("default_call")
    call_p.multiple_results = True
    call_p.def_impl(lambda *xs, body: jaxpr_as_fun(body)(*xs))
    call_p.def_abstract_eval(lambda *xs, body: body.out_avals)
    bodies = lambda eqn: [extend.Body("default_call", eqn.params["body"].jaxpr)]  # noqa: E731
    extend.register(call_p, extend.HigherOrder(bodies, call=True))
    inner = lambda y: jnp.cos(sow(y * 3.0, name="h", mode="strict"))  # noqa: E731
    f = lambda x: call_p.bind(x, body=jax.make_jaxpr(inner)(x))[0]  # noqa: E731
    out, reaped = call_and_reap(f)(X)
    np.testing.assert_allclose(out, np.cos(3 * X), rtol=1e-6)
    np.testing.assert_allclose(reaped["h"], 3 * X, rtol=1e-6)
    np.testing.assert_allclose(plant(f)({"h": jnp.zeros(3)}, X), np.ones(3))
    # Not call-like and without a rule: a sow there is an error naming the primitive.
    other_p = Primitive("ruleless_loop")
    other_p.multiple_results = True
    other_p.def_impl(lambda *xs, body: jaxpr_as_fun(body)(*xs))
    other_p.def_abstract_eval(lambda *xs, body: body.out_avals)
    extend.register(other_p, extend.HigherOrder(bodies))
    g = lambda x: other_p.bind(x, body=jax.make_jaxpr(inner)(x))[0]  # noqa: E731
    with pytest.raises(
        NotImplementedError, match=r"no rule for the primitive `ruleless_loop`.*name='h'"
    ):
        reap(g)(X)


def _registered_twice_p(name: str, in_branch: bool) -> Primitive:
    """A primitive that runs its body twice in a row (not call-like), registered with a
    walk rule and, if `in_branch`, a `batched_branch` built from `walk_in_branch`."""
    twice_p = Primitive(name)
    twice_p.multiple_results = True
    run = lambda x, body: jaxpr_as_fun(body)(*jaxpr_as_fun(body)(x))  # noqa: E731
    twice_p.def_impl(lambda x, *, body: run(x, body))
    twice_p.def_abstract_eval(lambda x, *, body: [x])
    batching.primitive_batchers[twice_p] = lambda args, dims, *, body: (
        jax.vmap(lambda x: run(x, body), in_axes=dims)(*args),
        [0],
    )

    def walk_twice(walk, eqn, invals):
        body = eqn.params["body"]
        once = extend.walk_in_place(walk, body.jaxpr, body.consts, invals)
        return extend.walk_in_place(walk, body.jaxpr, body.consts, once)

    def twice_in_branch(eqn, invals, found, stuck):
        body = eqn.params["body"]
        once = extend.walk_in_branch(body.jaxpr, body.consts, invals, found, stuck)
        return extend.walk_in_branch(body.jaxpr, body.consts, once, found, stuck)

    bodies = lambda eqn: [extend.Body(name, eqn.params["body"].jaxpr, runs=2)]  # noqa: E731
    branch = twice_in_branch if in_branch else None
    extend.register(twice_p, extend.HigherOrder(bodies, rule=walk_twice, batched_branch=branch))
    return twice_p


def _twice_in_a_batched_cond(twice_p):
    def f(x):
        body = jax.make_jaxpr(lambda y: jnp.sin(sow(y * 2.0, name="h", mode="append")))(x)
        return jax.lax.cond(x > 0.0, lambda x: twice_p.bind(x, body=body)[0], jnp.cos, x)

    return jax.vmap(f)


def test_a_loop_like_primitive_in_a_batched_cond_is_reaped_through_its_batched_branch():
    xs = jnp.array([0.5, -1.0, 2.0])
    stuck = _twice_in_a_batched_cond(_registered_twice_p("twice_unbranched", in_branch=False))
    with pytest.raises(
        NotImplementedError, match=r"name='h'.*`twice_unbranched`.*`batched_branch`.*walk_in_branch"
    ):
        reap(stuck)(xs)
    # By hand: the body applied twice, h its input each time; where the branch is not
    # taken, the example's values are zeros.
    first = 2.0 * np.asarray(xs)
    second = 2.0 * np.sin(first)
    taken = np.asarray(xs) > 0
    fixed = _twice_in_a_batched_cond(_registered_twice_p("twice_branched", in_branch=True))
    out, reaped = call_and_reap(fixed)(xs)
    np.testing.assert_allclose(out, np.where(taken, np.sin(second), np.cos(xs)), rtol=1e-6)
    np.testing.assert_allclose(
        reaped["h"],
        np.stack([np.where(taken, first, 0.0), np.where(taken, second, 0.0)]),
        rtol=1e-6,
    )
    planted = plant(fixed)({"h": jnp.full((2, 3), 0.25)}, xs)
    np.testing.assert_allclose(planted, np.where(taken, np.sin(0.25), np.cos(xs)), rtol=1e-6)
