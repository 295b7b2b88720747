"""cond/switch with a batched predicate under vmap (harvest/_walk/_rules/batched_cond.py).

`reap(vmap(f))` must record, per example, only the branch that example took,
and `plant(vmap(f))` must plant into it; each is checked against a
hand-threaded per-example computation and against `vmap(reap(f))`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import close
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from jax import lax

from harvest import call_and_reap, harvest, plant, reap, sow, sow_cond

XS = jnp.array([1.0, -1.0, 2.0, -0.25])


def per_example(fn, xs=XS):
    """Stacks a hand-threaded per-example function's results over `xs`."""
    is_row = lambda l: isinstance(l, list)  # a list is one array: rows, or a vmap's examples
    outs = [
        jax.tree_util.tree_map(lambda l: jnp.asarray(l, jnp.float32), fn(float(x)), is_leaf=is_row)
        for x in xs
    ]
    return jax.tree_util.tree_map(lambda *ls: jnp.stack(ls), *outs)


# ---------------------------------------------------------------------------
# One mode at a time: two branches that sow different numbers of times.


def two_sows_or_one(mode):
    def f(x):
        taken = lambda y: sow(y * 2.0, name="h", mode=mode) + sow(y + 1.0, name="h", mode=mode)
        other = lambda y: sow(y * 3.0, name="h", mode=mode) - 1.0
        return lax.cond(x > 0, taken, other, x)

    return f


def test_collect_records_the_taken_branch_per_example():
    f = two_sows_or_one("collect")
    expect = per_example(lambda x: (x * 2.0, x + 1.0) if x > 0 else (x * 3.0, 0.0))
    out, reaped = call_and_reap(jax.vmap(f))(XS)
    close(reaped["h"], expect)
    close(out, per_example(lambda x: 3 * x + 1.0 if x > 0 else 3 * x - 1.0))
    close(jax.vmap(reap(f))(XS), reaped)


def test_append_zero_fills_rows_to_the_longest_branch_batch_axis_second():
    f = two_sows_or_one("append")
    rows = per_example(lambda x: [x * 2.0, x + 1.0] if x > 0 else [x * 3.0, 0.0])  # [batch, n]
    close(reap(jax.vmap(f))(XS)["h"], rows.T)  # [n, batch], as for any append under vmap
    close(jax.vmap(reap(f))(XS)["h"], rows)


def test_clobber_takes_the_taken_branchs_value_else_the_one_before():
    def f(x):
        sow(x, name="k", mode="clobber")
        return lax.switch(
            (x > 0).astype(jnp.int32) + (x > 1.5).astype(jnp.int32),
            [
                lambda y: y,
                lambda y: sow(y * 2.0, name="k", mode="clobber"),
                lambda y: sow(y * 5.0, name="k", mode="clobber"),
            ],
            x,
        )

    expect = per_example(lambda x: x if x <= 0 else (x * 2.0 if x <= 1.5 else x * 5.0))
    close(reap(jax.vmap(f))(XS)["k"], expect)
    close(jax.vmap(reap(f))(XS)["k"], expect)


def test_sow_cond_in_a_branch_where_its_pred_and_the_branch_hold():
    def f(x):
        sow_cond(x, x > -0.5, name="c")
        other = lambda y: (
            sow_cond(y * 2.0, y < -0.5, name="c") + sow_cond(y * 3.0, y < -2.0, name="c")
        )
        return lax.cond(x > 0, lambda y: y, other, x)

    expect = per_example(lambda x: x if x > -0.5 else x * 2.0)
    close(reap(jax.vmap(f))(XS)["c"], expect)
    close(jax.vmap(reap(f))(XS)["c"], expect)


def test_strict_is_zeros_where_the_taken_branch_did_not_sow():
    f = lambda x: lax.cond(x > 0, lambda y: sow(y * 2.0, name="s", mode="strict"), lambda y: y, x)
    expect = per_example(lambda x: x * 2.0 if x > 0 else 0.0)
    close(reap(jax.vmap(f))(XS)["s"], expect)
    close(jax.vmap(reap(f))(XS)["s"], expect)


def test_strict_in_both_branches_is_one_occurrence():
    f = lambda x: lax.cond(
        x > 0,
        lambda y: sow(y, name="s", mode="strict"),
        lambda y: sow(-y, name="s", mode="strict"),
        x,
    )
    close(reap(jax.vmap(f))(XS)["s"], jnp.abs(XS))
    close(plant(jax.vmap(f))({"s": 7.0}, XS), jnp.full(4, 7.0))


# ---------------------------------------------------------------------------
# Plant: into the taken branch, where downstream code sees it.


def test_plant_per_occurrence_counts_each_branch_from_the_cond():
    f = two_sows_or_one("collect")
    plants = {"h": (10.0, 20.0)}
    expect = per_example(lambda x: 30.0 if x > 0 else 9.0)  # the other branch: 10 - 1
    close(plant(jax.vmap(f))(plants, XS), expect)
    close(jax.vmap(lambda x: plant(f)(plants, x))(XS), expect)


def test_plant_callable_and_per_example_values():
    f = two_sows_or_one("collect")
    close(
        plant(jax.vmap(f))({"h": lambda old: old * 0.0 + 1.0}, XS),
        per_example(lambda x: 2.0 if x > 0 else 0.0),
    )
    per = jnp.array([1.0, 2.0, 3.0, 4.0])  # one value per example, at both occurrences
    close(
        plant(jax.vmap(f))({"h": (per, per)}, XS),
        per_example(lambda x: 0.0) + jnp.where(XS > 0, 2 * per, per - 1.0),
    )


def test_plant_append_rows_into_the_taken_branch():
    f = two_sows_or_one("append")
    rows = jnp.array([[10.0], [20.0]]) + jnp.zeros((2, 4))  # [n, batch]
    close(
        plant(jax.vmap(f))({"h": rows}, XS),
        per_example(lambda x: 30.0 if x > 0 else 9.0),
    )


def test_harvest_plants_one_name_and_reaps_another():
    def f(x):
        return lax.cond(
            x > 0,
            lambda y: sow(sow(y, name="p") * 2.0, name="r"),
            lambda y: sow(sow(y, name="p") * 3.0, name="r") + 0.0 * sow(y, name="r"),
            x,
        )

    out, reaped = harvest(jax.vmap(f))({"p": 5.0}, XS)
    close(out, per_example(lambda x: 10.0 if x > 0 else 15.0))
    close(reaped, {"r": per_example(lambda x: (10.0, 0.0) if x > 0 else (15.0, x))})


# ---------------------------------------------------------------------------
# Where the sows sit inside the branch.


def test_sows_inside_jit_and_a_nested_cond():
    def f(x):
        first = lambda y: jax.jit(lambda z: sow(z * 2.0, name="a", mode="append") + 1.0)(y)
        inner = lambda y: lax.cond(
            y < -0.5, lambda w: sow(w * 3.0, name="a", mode="append"), lambda w: w, y
        )
        return lax.cond(x > 0, first, inner, x)

    rows = per_example(lambda x: [x * 2.0] if x > 0 else [x * 3.0 if x < -0.5 else 0.0])
    close(reap(jax.vmap(f))(XS)["a"], rows.T)
    close(jax.vmap(reap(f))(XS)["a"], rows)
    close(
        plant(jax.vmap(f))({"a": lambda old: old * 0.0 + 7.0}, XS),
        per_example(lambda x: 8.0 if x > 0 else (7.0 if x < -0.5 else x)),
    )


def test_nested_cond_with_an_unbatched_predicate():
    def f(x, flag):
        inner = lambda y: lax.cond(
            flag, lambda w: sow(w * 3.0, name="n"), lambda w: sow(w * 4.0, name="n"), y
        )
        return lax.cond(x > 0, inner, lambda y: y, x)

    for flag in (True, False):
        k = 3.0 if flag else 4.0
        reaped = reap(jax.vmap(f, in_axes=(0, None)))(XS, flag)
        close(reaped["n"], per_example(lambda x, k=k: (x * k if x > 0 else 0.0,)))
        close(jax.vmap(reap(f), in_axes=(0, None))(XS, flag), reaped)


def test_vmap_inside_a_branch_of_a_batched_cond():
    # The inner vmap's records leave the outer branch as its own do.
    def f(x):
        def branch(y):
            g = lambda v: lax.cond(v > 0.5, lambda u: sow(u * 2.0, name="v"), lambda u: u, v)
            return jnp.sum(jax.vmap(g)(jnp.stack([y, y + 1.0])))

        return lax.cond(x > 0, branch, lambda y: y, x)

    def ref(x):
        if x <= 0:
            return ([0.0, 0.0],)
        return ([v * 2.0 if v > 0.5 else 0.0 for v in (x, x + 1.0)],)

    close(reap(jax.vmap(f))(XS)["v"], per_example(ref))


def test_vmap_inside_scan_records_each_iteration_per_example():
    def f(x):
        step = lambda c, t: (
            lax.cond(c > 0, lambda y: sow(y * t, name="s", mode="append"), lambda y: -y, c),
            None,
        )
        return lax.scan(step, x, jnp.arange(1.0, 4.0))[0]

    def ref(x):
        rows = []
        for t in (1.0, 2.0, 3.0):
            rows.append(x * t if x > 0 else 0.0)
            x = x * t if x > 0 else -x
        return rows

    xs = jnp.array([1.0, -1.0, 0.5])
    step = lambda c, t: (
        jax.vmap(
            lambda ci: lax.cond(
                ci > 0, lambda y: sow(y * t, name="s", mode="append"), lambda y: -y, ci
            )
        )(c),
        None,
    )
    g = lambda xs: lax.scan(step, xs, jnp.arange(1.0, 4.0))[0]
    close(reap(g)(xs)["s"], per_example(ref, xs).T)
    close(reap(jax.vmap(f))(xs)["s"], per_example(ref, xs).T)


@pytest.mark.parametrize("mode", ["collect", "append", "clobber", "sow_cond"])
@pytest.mark.parametrize("reverse", [False, True])
def test_a_scan_in_a_batched_branch_records_each_iteration(mode, reverse):
    def f(x):
        def body(c, t):
            v = c * t
            v = (
                sow_cond(v, v > 1.5, name="h")
                if mode == "sow_cond"
                else sow(v, name="h", mode=mode)
            )
            return c + 0.5 * v, None

        loop = lambda y: lax.scan(body, y, jnp.arange(1.0, 4.0), reverse=reverse)[0]
        return lax.cond(x > 0, loop, lambda y: y * 2.0, x)

    def ref(x):  # (values per iteration in index order, whether each was recorded, output)
        if x <= 0:
            return [0.0] * 3, [False] * 3, x * 2.0
        vals, c = [0.0] * 3, x
        for t in [2, 1, 0] if reverse else [0, 1, 2]:
            vals[t] = c * (t + 1.0)
            c = c + 0.5 * vals[t]
        return vals, [v > 1.5 if mode == "sow_cond" else True for v in vals], c

    vals = per_example(lambda x: ref(x)[0])  # [batch, 3]
    held = np.array([ref(float(x))[1] for x in XS])
    rows = {
        "collect": (vals.T,),
        "append": vals.T,
    }  # the loop axis first, as for any scan under vmap
    order = [2, 1, 0] if reverse else [0, 1, 2]
    last = [next((vals[b, t] for t in reversed(order) if held[b, t]), 0.0) for b in range(len(XS))]
    expect = rows.get(mode, jnp.array(last))
    out, reaped = call_and_reap(jax.vmap(f))(XS)
    close(reaped["h"], expect)
    close(out, per_example(lambda x: ref(x)[2]))
    per = jax.vmap(reap(f))(XS)["h"]
    close(per, jax.tree_util.tree_map(lambda v: v.T, expect) if mode in rows else expect)
    twice = plant(jax.vmap(f))({"h": lambda old: old * 2.0}, XS)
    close(twice, jax.vmap(lambda x: plant(f)({"h": lambda old: old * 2.0}, x))(XS))


def test_a_sow_in_a_while_loop_in_a_batched_branch_is_an_error_naming_it():
    def f(x):
        loop = lambda y: lax.while_loop(
            lambda c: c < 5.0, lambda c: sow(c + 1.0, name="looped", mode="clobber"), y
        )
        return lax.cond(x > 0, loop, lambda y: y, x)

    with pytest.raises(
        NotImplementedError, match=r"name='looped'.*while_loop.*jax.vmap\(reap\(f\)\)"
    ):
        reap(jax.vmap(f))(XS)
    # Planting needs no record: it is right in every branch.
    close(plant(jax.vmap(f))({"looped": 6.0}, XS), per_example(lambda x: 6.0 if x > 0 else x))
    # Once planted, nothing is left for an outer reap to miss.
    close(reap(lambda xs: plant(jax.vmap(f))({"looped": 6.0}, xs))(XS), {})
    # A walk of another tag is unaffected (reaping a tag f never sows is an error of its own).
    close(plant(jax.vmap(f), tag="other")({}, XS), jax.vmap(f)(XS))


# ---------------------------------------------------------------------------
# Other tags, transformations around, and nothing changed outside a harvest.


def test_other_tags_stay_per_example_through_an_inner_harvest():
    def f(x):
        both = lambda y: sow(sow(y * 2.0, name="x", tag="a") + 1.0, name="y", tag="b")
        return lax.cond(x > 0, both, lambda y: sow(y, name="x", tag="a") * 0.0, x)

    expect_y = per_example(lambda x: (x * 2.0 + 1.0,) if x > 0 else (0.0,))
    close(reap(jax.vmap(f), tag="b")(XS), {"y": expect_y})
    planted = plant(jax.vmap(f), tag="a")
    close(
        reap(lambda p, xs: planted(p, xs), tag="b")({"x": 4.0}, XS),
        {"y": per_example(lambda x: (5.0,) if x > 0 else (0.0,))},
    )
    reaped_a = reap(lambda xs: reap(jax.vmap(f), tag="b")(xs), tag="a")(XS)
    close(reaped_a, {"x": per_example(lambda x: (x * 2.0,) if x > 0 else (x,))})


def test_jit_and_grad_of_reap_of_vmap():
    f = two_sows_or_one("collect")
    close(jax.jit(reap(jax.vmap(f)))(XS), reap(jax.vmap(f))(XS))
    grad = jax.grad(lambda xs: sum(jnp.sum(v**2) for v in reap(jax.vmap(f))(xs)["h"]))(XS)
    ref = jax.grad(lambda xs: sum(jnp.sum(v**2) for v in jax.vmap(reap(f))(xs)["h"]))(XS)
    close(grad, ref)
    close(grad, per_example(lambda x: 8 * x + 2 * (x + 1.0) if x > 0 else 18 * x))
    planted_grad = jax.grad(lambda xs: jnp.sum(plant(jax.vmap(f))({"h": (10.0, 20.0)}, xs)))(XS)
    close(planted_grad, jnp.zeros(4))


def test_reap_of_grad_of_vmap_records_forward_values_per_example():
    f = two_sows_or_one("collect")
    reaped = reap(jax.grad(lambda xs: jnp.sum(jax.vmap(f)(xs))))(XS)
    close(reaped, jax.vmap(reap(f))(XS))


def test_nothing_changes_without_a_harvest():
    f = two_sows_or_one("collect")
    text = str(jax.make_jaxpr(jax.vmap(f))(XS))
    assert "harvest_branch" not in text and "plant_only" not in text
    close(jax.vmap(f)(XS), per_example(lambda x: 3 * x + 1.0 if x > 0 else 3 * x - 1.0))


def test_different_shapes_per_branch_is_an_error_naming_the_site():
    f = lambda x: lax.cond(
        x > 0,
        lambda y: sow(jnp.stack([y, y]), name="w")[0],
        lambda y: sow(y, name="w"),
        x,
    )
    with pytest.raises(ValueError, match="name='w'.*different shapes"):
        reap(jax.vmap(f))(XS)


# ---------------------------------------------------------------------------
# Random predicates and values.


@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    xs=st.lists(st.floats(-3.0, 3.0, width=32), min_size=1, max_size=5),
    cut=st.floats(-2.0, 2.0, width=32),
    mode=st.sampled_from(["collect", "append", "clobber"]),
    planted=st.floats(-5.0, 5.0, width=32),
)
def test_random_predicates_match_per_example_harvest(xs, cut, mode, planted):
    def f(x):
        sow(x, name="h", mode=mode)
        branches = [
            lambda y: sow(y * 2.0, name="h", mode=mode) + sow(y - 1.0, name="h", mode=mode),
            lambda y: y * 0.5,
            lambda y: sow(jnp.sin(y), name="h", mode=mode) * 3.0,
        ]
        index = (x > cut).astype(jnp.int32) + (x > cut + 1.0).astype(jnp.int32)
        return lax.switch(index, branches, x)

    xs = jnp.array(xs, jnp.float32)
    by_vmap = reap(jax.vmap(f))(xs)["h"]
    per = jax.vmap(reap(f))(xs)["h"]
    close(by_vmap, per.T if mode == "append" else per)
    close(
        plant(jax.vmap(f))({"h": planted}, xs),
        jax.vmap(lambda x: plant(f)({"h": planted}, x))(xs),
    )
