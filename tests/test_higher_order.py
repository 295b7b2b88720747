"""One description per higher-order primitive (harvest/_walk/_higher_order.py), one evaluator
(harvest/_walk/_evaluator.py): the tools that read them agree with each other and with
the hand-written function."""

from __future__ import annotations

import pathlib
import re

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import harvest.ppl as ppl
from harvest import _jax, instrument, patching_sweep, plant, reap, sites, sow
from harvest.ppl._inverse import inline_calls

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "harvest"
A = jnp.array([[4.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 2.0]])


def test_only_the_rules_name_higher_order_primitives():
    # Everything else asks a primitive's descriptor, so no two tools can disagree about it.
    allowed = {PACKAGE / "_jax.py"} | set((PACKAGE / "_walk" / "_rules").glob("*.py"))
    hits = [
        f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
        for p in sorted(PACKAGE.rglob("*.py"))
        if p not in allowed
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"_jax\.\w+_p\b|\bCALL_PRIMITIVES\b", line) or _reads_a_param(line)
    ]
    assert not hits, "\n".join(hits)


# The params only one higher-order primitive has (a while's, a scan's, a cond's,
# a shard_map's, ...): read through `_jax`'s param classes and the descriptors.
_PRIMITIVE_PARAMS = (
    "cond_nconsts|body_nconsts|cond_jaxpr|body_jaxpr|num_carry|num_consts|branches|"
    "const_lengths|jvp_jaxpr_fun|fwd_jaxpr_thunk|call_jaxpr|fun_jaxpr|in_specs|out_specs|"
    "manual_axes|newly_manual_axes|check_vma"
)


def _reads_a_param(line):
    read = rf"""(params|\bp)(\[|\.get\()["']({_PRIMITIVE_PARAMS})["']"""
    tested = rf"""["']({_PRIMITIVE_PARAMS})["'] in (\w+\.)?(params|p)\b"""
    return re.search(read, line) or re.search(tested, line)


def refined(mode):
    """Solves A x = b by one refinement step from b: `solve` calls `matvec` once."""

    def matvec(v):
        return sow(A @ v, name="Av", mode=mode)

    def solve(mv, b):
        return b + sow(jnp.linalg.solve(A, b - mv(b)), name="step", mode=mode)

    return lambda b: lax.custom_linear_solve(matvec, b, solve, symmetric=True)


@pytest.mark.parametrize("mode", ["strict", "append"])
def test_sites_of_custom_linear_solve_fire_as_reap_returns(mode):
    f = refined(mode)
    b = jnp.array([1.0, -2.0, 0.5])
    listed = sites(f)(b)
    # Only `solve` runs in a call (its jaxpr holds the matvec it calls); the
    # transposed solve runs only where JAX differentiates.
    assert [(s.name, s.fires, s.where) for s in listed] == [
        ("Av", 1, "custom_linear_solve.solve"),
        ("step", 1, "custom_linear_solve.solve"),
    ]
    reaped = reap(f)(b)
    assert {n: jnp.shape(v)[0] if mode == "append" else 1 for n, v in reaped.items()} == {
        s.name: s.fires for s in listed
    }


def test_patching_sweep_inside_custom_linear_solve_matches_patching_by_hand():
    f = refined("strict")
    clean_b, corrupt_b = jnp.array([1.0, -2.0, 0.5]), jnp.array([0.3, 0.2, -1.0])
    clean = reap(f)(clean_b)
    result = patching_sweep(f, clean, (corrupt_b,), jnp.sum)

    def by_hand(b, av=None, step=None):  # `refined` written out, one value replaced
        av = A @ b if av is None else av
        step = jnp.linalg.solve(A, b - av) if step is None else step
        return jnp.sum(b + step)

    base = by_hand(corrupt_b)
    expected = [
        by_hand(corrupt_b, av=A @ clean_b) - base,
        by_hand(corrupt_b, step=jnp.linalg.solve(A, clean_b - A @ clean_b)) - base,
    ]
    assert result.names == ("Av", "step")
    conftest.close(result.values, np.array(expected), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Every evaluator re-enters each equation's name stack, as the core walk does.


def scoped(x):
    with jax.named_scope("block"):
        return jnp.exp(sow(jnp.sin(x), name="h", mode="strict"))


def _scopes(closed, prim):
    """The name stacks of every `prim` equation in `closed`, nested bodies included."""
    found = []

    def visit(jaxpr, outer):
        for e in jaxpr.eqns:
            stack = outer + str(e.source_info.name_stack)
            if e.primitive is prim:
                found.append(stack)
            for sub in _jax.sub_jaxprs(e):
                visit(sub, stack + "/")

    visit(closed.jaxpr, "")
    return found


def test_named_scopes_survive_every_evaluator():
    x = jnp.ones(3)
    core = _scopes(jax.make_jaxpr(lambda x: plant(scoped)({}, x))(x), lax.exp_p)
    assert core and all("block" in s for s in core)
    handled = ppl.make_effect_handler({lax.sin_p: lambda n, x, **p: (jnp.sin(x), n + 1)})
    assert _scopes(jax.make_jaxpr(lambda x: handled(scoped)(0, x)[0])(x), lax.exp_p) == core
    # Op sites name each op from the scope it was staged under.
    names = reap(instrument(scoped, ops=True, tag="ops"), tag="ops")(x)
    assert any(n.startswith("block/exp") for n in names), list(names)
    # harvest.ppl's inversion evaluates an inlined copy of the program.
    inlined = inline_calls(jax.make_jaxpr(jax.jit(scoped))(x))
    assert _scopes(inlined, lax.exp_p) == core
    # A batched cond rewrites its branches.
    branchy = lambda x: lax.cond(x.sum() > 0, scoped, jnp.cos, x)  # noqa: E731
    rows = jnp.stack([x, -x])
    batched = _scopes(jax.make_jaxpr(reap(jax.vmap(branchy)))(rows), lax.exp_p)
    assert batched and all("block" in s for s in batched)


def test_effect_handler_keeps_a_custom_jvp_rule_it_does_not_handle():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda primals, tangents: (f(*primals), 123.0 * tangents[0]))
    counting = ppl.make_effect_handler({lax.exp_p: lambda n, x, **p: (jnp.exp(x), n + 1)})
    grad = jax.grad(lambda x: counting(lambda x: jnp.exp(f(x)))(0, x)[0])(0.0)
    # d/dx exp(f(x)) = exp(f(0)) * 123, by the user's rule for f.
    np.testing.assert_allclose(grad, 123.0, rtol=1e-6)
    assert counting(lambda x: jnp.exp(f(x)))(0, 0.0)[1] == 1


# make_effect_handler against the function itself: through custom derivatives,
# loops and branches, counting every exp that runs.

counting = ppl.make_effect_handler({lax.exp_p: lambda n, x, **p: (jnp.exp(x), n + 1)})


@jax.custom_jvp
def exp_with_rule(x):
    return jnp.exp(x)


exp_with_rule.defjvp(lambda primals, tangents: (exp_with_rule(*primals), 123.0 * tangents[0]))


@jax.custom_vjp
def exp_with_vjp(x):
    return jnp.exp(x)


exp_with_vjp.defvjp(lambda x: (exp_with_vjp(x), None), lambda _, g: (-7.0 * g,))


def test_effect_handler_keeps_the_rule_of_a_custom_jvp_it_walks_into():
    x = 0.5
    out, count = counting(exp_with_rule)(0, x)
    assert count == 1
    np.testing.assert_allclose(out, np.exp(x), rtol=1e-6)
    grad = jax.grad(lambda x: counting(exp_with_rule)(0, x)[0])(x)
    np.testing.assert_allclose(grad, jax.grad(exp_with_rule)(x), rtol=1e-6)  # 123, the rule's
    np.testing.assert_allclose(grad, 123.0)
    # As the core walk: reaping inside the call keeps the rule too.
    reaped = jax.grad(lambda x: plant(exp_with_rule)({}, x))(x)
    np.testing.assert_allclose(grad, reaped)


def test_effect_handler_keeps_the_rule_of_a_custom_vjp_it_walks_into():
    grad = jax.grad(lambda x: counting(exp_with_vjp)(0, x)[0])(0.5)
    np.testing.assert_allclose(grad, -7.0)
    assert counting(exp_with_vjp)(0, 0.5)[1] == 1


def test_effect_handler_values_flow_through_a_custom_jvp_it_walks_into():
    doubling = ppl.make_effect_handler({lax.exp_p: lambda n, x, **p: (2.0 * jnp.exp(x), n)})
    out, _ = doubling(exp_with_rule)(None, 0.5)
    np.testing.assert_allclose(out, 2.0 * np.exp(0.5), rtol=1e-6)


def looped(x):
    def body(c, _):
        return jnp.exp(c) * 0.1, None

    c = lax.scan(body, x, None, length=3)[0]
    c = lax.fori_loop(0, 2, lambda i, c: jnp.exp(c) * 0.1, c)
    c = lax.while_loop(lambda c: c < 5.0, lambda c: c + jnp.exp(0.1 * c), c)
    return lax.cond(c > 0, jnp.exp, jnp.sin, c)


def test_effect_handler_threads_its_state_through_loops_and_branches():
    x = jnp.float32(0.3)
    out, count = jax.jit(counting(looped))(0, x)
    np.testing.assert_allclose(out, looped(x), rtol=1e-6)
    # By hand: 3 scan steps, 2 fori steps, one exp per while step, one in the taken branch.
    c, trips = looped_trips(x)
    assert int(count) == 3 + 2 + trips + 1
    handled_jvp = jax.jvp(lambda x: counting(looped)(0, x)[0], (x,), (1.0,))
    conftest.close(handled_jvp, jax.jvp(looped, (x,), (1.0,)), rtol=1e-5)  # while: forward mode


def looped_trips(x):
    c = x
    for _ in range(5):
        c = np.exp(c) * 0.1
    trips = 0
    while c < 5.0:
        c, trips = c + np.exp(0.1 * c), trips + 1
    return c, trips
