"""The adapter to JAX's internals (harvest/_jax.py)."""

from __future__ import annotations

import pathlib
import re
import types

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from harvest import _jax, reap, sites, sow

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "harvest"


def _sources():
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "_jax.py" or p.parent != PACKAGE)


# Primitives are compared by object: JAX renames them between releases.
NAME_TESTS = r"(prim|primitive)\.name\s*(==|!=|in\b)|\.name\.startswith|\"(pjit|remat2?|closed_call|core_call)\""


@pytest.mark.parametrize(
    "pattern", [r"jax\._src", r"jax\.interpreters", r"jax\.extend", NAME_TESTS]
)
def test_only_the_adapter_reaches_jax_internals(pattern):
    hits = [
        f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
        for p in _sources()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(pattern, line)
        and not line.lstrip().startswith((">>>", "..."))  # user code in examples
    ]
    assert not hits, "\n".join(hits)


def _eqn(f, *args, primitive):
    return next(e for e in jax.make_jaxpr(f)(*args).jaxpr.eqns if e.primitive is primitive)


def test_primitives_are_the_ones_jax_stages():
    x = jnp.ones(3)
    assert _eqn(jax.jit(jnp.sin), x, primitive=_jax.jit_p)
    assert _eqn(jax.checkpoint(jnp.sin), x, primitive=_jax.remat_p)
    assert _eqn(lambda x: lax.scan(lambda c, y: (c + y, y), 0.0, x), x, primitive=_jax.scan_p)
    assert _eqn(
        lambda x: lax.while_loop(lambda c: c < 3, lambda c: c + 1, x), 0, primitive=_jax.while_p
    )
    assert _eqn(lambda x: lax.cond(x > 0, jnp.sin, jnp.cos, x), 1.0, primitive=_jax.cond_p)


def test_params_views_match_what_the_equation_does():
    xs = jnp.arange(4.0)
    eqn = _eqn(
        lambda xs: lax.scan(lambda c, x: (c + x, 2 * x), 0.0, xs, reverse=True),
        xs,
        primitive=_jax.scan_p,
    )
    scan = _jax.Scan.of(eqn)
    assert (scan.length, scan.num_consts, scan.num_carry, scan.reverse) == (4, 0, 1, True)
    # Re-binding the equation through the adapter computes what the scan computes.
    carry, ys = _jax.rebind(eqn, [jnp.zeros(()), xs])
    assert float(carry) == 6.0 and ys.tolist() == [0.0, 2.0, 4.0, 6.0]

    eqn = _eqn(
        lambda x: lax.while_loop(lambda c: c < 5.0, lambda c: c * 2.0, x),
        1.0,
        primitive=_jax.while_p,
    )
    loop = _jax.While.of(eqn)
    assert (loop.cond_nconsts, loop.body_nconsts) == (0, 0)
    assert float(_jax.eval_jaxpr(loop.body.jaxpr, loop.body.consts, 3.0)[0]) == 6.0

    eqn = _eqn(lambda x: lax.cond(x > 0, jnp.sin, jnp.cos, x), 1.0, primitive=_jax.cond_p)
    assert len(_jax.cond_branches(eqn)) == 2


def test_bind_with_takes_both_shapes_of_get_bind_params():
    class Old(_jax.Primitive):
        def get_bind_params(self, params):  # older releases: (subfuns, params)
            return [], dict(params)

    for prim in (_jax.Primitive("new_style"), Old("old_style")):
        prim.def_impl(lambda x, *, k: x * k)
        prim.def_abstract_eval(lambda x, *, k: x)
        assert float(_jax.bind_with(prim, {"k": 3.0}, [2.0])) == 6.0


@pytest.mark.parametrize("key", ["newly_manual_axes", "manual_axes"])
def test_shard_map_view_reads_either_name_of_the_manual_axes(key):
    mesh = types.SimpleNamespace(axis_names=("a", "b", "c"))
    params = dict(
        mesh=mesh,
        jaxpr=None,
        in_specs=[],
        out_specs=[],
        check_vma=True,
        **{key: frozenset({"c", "a"})},
    )
    view = _jax.ShardMap.of(types.SimpleNamespace(params=params))
    assert view.axes == ("a", "c")  # in mesh order


def test_varying_axes_outside_shard_map_is_empty():
    assert _jax.varying_axes(jnp.ones(2)) == frozenset()
    x = jnp.ones(2)
    assert _jax.pcast_varying(x, ()) is x


def test_is_staging_follows_the_current_trace():
    seen = []

    def f(x):
        seen.append(_jax.is_staging())
        return x

    f(1.0)
    jax.jit(f)(1.0)
    jax.vmap(f)(jnp.ones(2))
    assert seen == [False, True, False]


def test_sites_labels_calls_by_primitive_not_name():
    def f(x):
        x = jax.checkpoint(lambda y: sow(y, name="c"))(x)
        return jax.jit(lambda y: sow(y, name="j"))(x)

    where = {s.name: s.where for s in sites(f)(1.0)}
    assert where == {"c": "checkpoint", "j": "jit"}
    assert reap(f)(1.0) == {"c": (1.0,), "j": (1.0,)}


def test_a_jvp_rule_that_traces_only_where_differentiated_is_passed_over():
    @jax.custom_jvp
    def f(x):
        return sow(x * 2.0, name="h", mode="strict")

    def rule(primals, tangents):  # Python branching on a primal: traces only with values
        sign = 1.0 if primals[0] > 0 else -1.0
        return f(primals[0]), sign * tangents[0]

    f.defjvp(rule)
    assert float(reap(f)(1.0)["h"]) == 2.0


def test_a_jvp_rule_that_fails_otherwise_is_named():
    @jax.custom_jvp
    def broken(x):
        return sow(x * 2.0, name="h", mode="strict")

    broken.defjvp(lambda primals, tangents: (broken(primals[0]), tangents[0] @ jnp.ones(3)))
    # Nothing differentiates: the rule is not traced, as under jax.jit.
    assert reap(broken)(1.0) == {"h": 2.0}
    # Differentiated, the rule fails as it does under jax.grad alone.
    with pytest.raises(ValueError, match="matmul"):
        jax.grad(broken)(1.0)
    with pytest.raises(ValueError, match="matmul"):
        reap(jax.grad(broken))(1.0)
