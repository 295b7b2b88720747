"""Sows inside scan, fori_loop, while_loop, cond and switch."""

import functools

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

from harvest import call_and_reap, harvest, nest, plant, reap, sites, sow, sow_cond


def close(a, b):
    conftest.close(a, b, rtol=1e-5, atol=1e-5)


XS = jnp.array([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5], [1.0, 1.0]], jnp.float32)  # length 4
C0 = jnp.array([0.1, -0.2], jnp.float32)


# ---------------------------------------------------------------------------
# scan: one body used by several tests, and its hand-threaded reference.


def make_scan(mode, reverse=False, unroll=1, tag="intermediates"):
    def f(c0, xs):
        def body(c, x):
            a = sow(jnp.tanh(c + x), name="a", mode=mode, tag=tag)
            b = sow(a * 2.0 - x, name="b", mode=mode, tag=tag)
            return b, a * x

        return lax.scan(body, c0, xs, reverse=reverse, unroll=unroll)

    return f


def ref_scan(c0, xs, reverse=False, plant_a=None, plant_b=None):
    """Hand-threaded: returns (carry, ys, a_i, b_i) with a_i/b_i indexed like xs.

    plant_a/plant_b: callables (i, old) -> new, or None.
    """
    n = xs.shape[0]
    order = range(n - 1, -1, -1) if reverse else range(n)
    c = c0
    a_s, b_s, ys = [None] * n, [None] * n, [None] * n
    for i in order:
        a = jnp.tanh(c + xs[i])
        if plant_a is not None:
            a = plant_a(i, a)
        b = a * 2.0 - xs[i]
        if plant_b is not None:
            b = plant_b(i, b)
        a_s[i], b_s[i], ys[i] = a, b, a * xs[i]
        c = b
    return c, jnp.stack(ys), jnp.stack(a_s), jnp.stack(b_s), list(order)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("unroll", [1, 2])
def test_scan_collect_and_append_aligned_with_iterations(reverse, unroll):
    c, ys, a, b, _ = ref_scan(C0, XS, reverse)
    fc = make_scan("collect", reverse, unroll)
    out, r = call_and_reap(fc)(C0, XS)
    close(out, (c, ys))
    close(r, {"a": (a,), "b": (b,)})
    fa = make_scan("append", reverse, unroll)
    close(reap(fa)(C0, XS), {"a": a, "b": b})


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_clobber_is_last_executed_iteration(reverse):
    c, ys, a, b, order = ref_scan(C0, XS, reverse)
    last = order[-1]
    close(reap(make_scan("clobber", reverse))(C0, XS), {"a": a[last], "b": b[last]})


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_plant_per_iteration_single_and_callable(reverse):
    new = jnp.arange(8.0).reshape(4, 2) / 8.0
    c, ys, *_ = ref_scan(C0, XS, reverse, plant_a=lambda i, old: new[i])
    close(plant(make_scan("collect", reverse))({"a": (new,)}, C0, XS), (c, ys))
    close(plant(make_scan("append", reverse))({"a": new}, C0, XS), (c, ys))
    # a single value at every iteration
    v = jnp.array([0.3, -0.3])
    c, ys, *_ = ref_scan(C0, XS, reverse, plant_b=lambda i, old: v)
    for mode in ["collect", "append", "clobber"]:
        close(plant(make_scan(mode, reverse))({"b": v}, C0, XS), (c, ys))
    # a callable at every iteration
    c, ys, *_ = ref_scan(C0, XS, reverse, plant_a=lambda i, old: old * -3.0)
    for mode in ["collect", "append", "clobber"]:
        close(plant(make_scan(mode, reverse))({"a": lambda old: old * -3.0}, C0, XS), (c, ys))


@pytest.mark.parametrize("rows", [2, 5])
def test_scan_collect_plant_with_another_count_of_rows_is_refused(rows):
    # 4 iterations: 2 rows would have iterations 2 and 3 read row 1, 5 drop row 4.
    f = make_scan("collect")
    with pytest.raises(ValueError, match=rf"name='a'.* {rows} rows.* 4 iterations.*Plant 4 rows"):
        plant(f)({"a": (jnp.zeros((rows, 2)),)}, C0, XS)
    new = jnp.arange(8.0).reshape(4, 2) / 8.0
    c, ys, *_ = ref_scan(C0, XS, plant_a=lambda i, old: new[i])
    close(plant(f)({"a": (new,)}, C0, XS), (c, ys))


@pytest.mark.parametrize("mode", ["collect", "append"])
def test_scan_round_trip(mode):
    f = make_scan(mode)
    close(plant(f)(reap(f)(C0, XS), C0, XS), f(C0, XS))


def test_scan_harvest_plants_one_reaps_other():
    new = jnp.ones((4, 2)) * 0.5
    c, ys, a, b, _ = ref_scan(C0, XS, plant_a=lambda i, old: new[i])
    out, r = harvest(make_scan("append"))({"a": new}, C0, XS)
    close(out, (c, ys))
    close(r, {"b": b})


def test_scan_two_sows_same_name_per_iteration():
    def f(xs):
        def body(c, x):
            sow(x, name="v", mode="collect")
            sow(x * 10.0, name="v", mode="collect")
            sow(x + 1.0, name="w", mode="append")
            sow(x + 2.0, name="w", mode="append")
            return c, None

        return lax.scan(body, 0.0, xs)[0]

    r = reap(f)(XS)
    close(r["v"], (XS, XS * 10.0))
    # append rows: iteration-major, two rows per iteration
    expect_w = jnp.stack([row for i in range(4) for row in (XS[i] + 1.0, XS[i] + 2.0)])
    close(r["w"], expect_w)
    close(plant(f)(r, XS), f(XS))


def test_scan_sows_before_and_after_loop():
    def f(xs):
        z = sow(jnp.zeros(2), name="v", mode="append")

        def body(c, x):
            return c + sow(x, name="v", mode="append"), None

        c = lax.scan(body, z, xs)[0]
        return c, sow(c * 2.0, name="v", mode="append")

    total = jnp.sum(XS, axis=0)
    close(reap(f)(XS), {"v": jnp.concatenate([jnp.zeros((1, 2)), XS, 2.0 * total[None]])})
    # planting stacked rows before, inside and after
    new = jnp.arange(12.0).reshape(6, 2)
    close(plant(f)({"v": new}, XS), (jnp.sum(new[:5], axis=0), new[5]))


def test_scan_length_only_xs_none():
    def f(c0):
        def body(c, _):
            c = sow(c * 2.0 + 1.0, name="c", mode="append")
            return c, None

        return lax.scan(body, c0, None, length=3)[0]

    c1 = C0 * 2 + 1
    c2 = c1 * 2 + 1
    c3 = c2 * 2 + 1
    close(reap(f)(C0), {"c": jnp.stack([c1, c2, c3])})
    close(plant(f)({"c": lambda c: c * 0.0}, C0), jnp.zeros(2))


def nested_scan_f(xss):
    def outer(c, xs):
        def inner(c, x):
            v = sow(c * x, name="v", mode="collect")
            return c + v, None

        c, _ = lax.scan(inner, c, xs)
        sow(c, name="end", mode="append")
        return c, None

    return lax.scan(outer, jnp.ones(2), xss)[0]


XSS = jnp.arange(12.0).reshape(2, 3, 2) / 10.0


def ref_nested_scan(xss):
    c = jnp.ones(2)
    vs, ends = np.zeros((2, 3, 2), np.float32), []
    for i in range(2):
        for j in range(3):
            v = c * xss[i, j]
            vs[i, j] = v
            c = c + v
        ends.append(c)
    return c, jnp.asarray(vs), jnp.stack(ends)


def test_nested_scans_reap():
    c, vs, ends = ref_nested_scan(XSS)
    out, r = call_and_reap(nested_scan_f)(XSS)
    close(out, c)
    close(r, {"v": (vs,), "end": ends})


def test_nested_scans_plant():
    f, xss = nested_scan_f, XSS
    r = reap(f)(xss)
    # plant per-iteration values in the inner scan, stacked as reap returns them
    pv = jnp.full((2, 3, 2), 0.5)
    close(plant(f)({"v": (pv,)}, xss), jnp.ones(2) + 6 * 0.5)
    close(plant(f)(r, xss), f(xss))
    # a single value or callable reaches every inner iteration
    close(plant(f)({"v": jnp.full(2, 0.5)}, xss), jnp.ones(2) + 6 * 0.5)
    close(plant(f)({"v": lambda v: v * 0.0}, xss), jnp.ones(2))


def test_fori_loop_static_bounds():
    def f(x):
        def body(i, c):
            return sow(c * 0.5 + i, name="c", mode="collect")

        return lax.fori_loop(0, 3, body, x)

    c = X2 = jnp.array([1.0, 4.0])
    steps = []
    for i in range(3):
        c = c * 0.5 + i
        steps.append(c)
    close(reap(f)(X2), {"c": (jnp.stack(steps),)})
    close(plant(f)({"c": lambda c: c + 1.0}, X2), (((X2 * 0.5 + 1) * 0.5 + 1 + 1) * 0.5 + 2 + 1))


def test_scan_sow_cond_last_iteration_where_pred_held():
    def f(xs):
        def body(c, x):
            sow_cond(x, x[0] > 0.4, name="pick")
            c = c + sow_cond(x * 2.0, x[0] > 100.0, name="never")
            return c, None

        return lax.scan(body, jnp.zeros(2), xs)[0]

    # x[0] > 0.4 holds for rows 0, 1, 3 -> last is 3
    close(reap(f)(XS), {"pick": XS[3], "never": jnp.zeros(2)})

    # reverse: executed order 3,2,1,0 -> last where held is 0
    def g(xs):
        def body(c, x):
            sow_cond(x, x[0] > 0.4, name="pick")
            return c, None

        return lax.scan(body, 0.0, xs, reverse=True)[0]

    close(reap(g)(XS), {"pick": XS[0]})
    # plant replaces only where pred held
    v = jnp.array([7.0, 7.0])

    def h(xs):
        def body(c, x):
            return c + sow_cond(x, x[0] > 0.4, name="pick"), None

        return lax.scan(body, jnp.zeros(2), xs)[0]

    close(plant(h)({"pick": v}, XS), 3 * v + XS[2])


def test_strict_in_scan_raises_and_suggests_modes():
    def f(xs):
        return lax.scan(lambda c, x: (c + sow(x, name="s", mode="strict"), None), 0.0, xs)[0]

    with pytest.raises(ValueError, match=r"(?s)strict.*(collect|append|clobber)"):
        reap(f)(XS[:, 0])
    with pytest.raises(ValueError, match=r"(?s)strict.*(collect|append|clobber)"):
        plant(f)({"s": 1.0}, XS[:, 0])


@settings(max_examples=15, deadline=None)
@given(
    xs=st.lists(st.floats(-2, 2, width=32), min_size=4, max_size=4),
    reverse=st.booleans(),
)
def test_scan_append_matches_reference_random(xs, reverse):
    xs = jnp.array(xs, jnp.float32).reshape(2, 2)
    xs4 = jnp.concatenate([xs, xs[::-1] * 0.5])
    c, ys, a, b, order = ref_scan(C0, xs4, reverse)
    out, r = call_and_reap(make_scan("append", reverse))(C0, xs4)
    close(out, (c, ys))
    close(r, {"a": a, "b": b})


# ---------------------------------------------------------------------------
# while_loop


def make_while(mode_or_cond):
    def f(x):
        def cond(c):
            return c[1] < 3

        def body(c):
            v, i = c
            if mode_or_cond == "sow_cond":
                v = sow_cond(v * 2.0 + 1.0, i == 1, name="v")
            else:
                v = sow(v * 2.0 + 1.0, name="v", mode=mode_or_cond)
            return v, i + 1

        return lax.while_loop(cond, body, (x, 0))[0]

    return f


X2 = jnp.array([1.0, -2.0], jnp.float32)


def test_while_clobber_and_sow_cond_reap():
    v1 = X2 * 2 + 1
    v2 = v1 * 2 + 1
    v3 = v2 * 2 + 1
    out, r = call_and_reap(make_while("clobber"))(X2)
    close(out, v3)
    close(r, {"v": v3})
    close(reap(make_while("sow_cond"))(X2), {"v": v2})


def test_while_zero_iterations_clobber_gives_zeros():
    def f(x):
        return lax.while_loop(
            lambda c: c[0] > 100.0, lambda c: sow(c * 2.0, name="v", mode="clobber"), x
        )

    close(reap(f)(X2), {"v": jnp.zeros(2)})


def test_while_plant_value_and_callable():
    v = jnp.array([5.0, 6.0])
    for mode in ["clobber", "sow_cond"]:
        f = make_while(mode)
        if mode == "clobber":
            expect = v
            expect_fn = ((X2 * 2 + 1) * -1 * 2 + 1) * -1 * 2 + 1
            expect_fn = -expect_fn
        else:  # only iteration 1 planted
            expect = v * 2 + 1
            v1 = X2 * 2 + 1
            expect_fn = (-(v1 * 2 + 1)) * 2 + 1
        close(plant(f)({"v": v}, X2), expect)
        close(plant(f)({"v": lambda old: -old}, X2), expect_fn)


@pytest.mark.parametrize("mode", ["collect", "append"])
def test_while_collect_append_raise_clear_error(mode):
    f = make_while(mode)
    with pytest.raises(ValueError, match=r"(?s)while_loop.*(scan|sow_cond)"):
        reap(f)(X2)


# ---------------------------------------------------------------------------
# cond / switch


def branchy(x, pred):
    def yes(x):
        h = sow(jnp.sin(x), name="h", mode="strict")
        sow(h * 3.0, name="only_yes", mode="collect")
        return h + 1.0

    def no(x):
        h = sow(jnp.cos(x), name="h", mode="strict")
        return h - 1.0

    return lax.cond(pred, yes, no, x)


@pytest.mark.parametrize("pred", [True, False])
def test_cond_reaps_taken_branch_zero_fills_other(pred):
    out, r = call_and_reap(branchy)(X2, jnp.bool_(pred))
    if pred:
        close(out, jnp.sin(X2) + 1.0)
        close(r, {"h": jnp.sin(X2), "only_yes": (jnp.sin(X2) * 3.0,)})
    else:
        close(out, jnp.cos(X2) - 1.0)
        close(r, {"h": jnp.cos(X2), "only_yes": (jnp.zeros(2),)})


@pytest.mark.parametrize("pred", [True, False])
def test_cond_plant_into_branch_that_runs(pred):
    v = jnp.array([0.25, 0.5])
    out = plant(branchy)({"h": v}, X2, jnp.bool_(pred))
    close(out, v + 1.0 if pred else v - 1.0)
    out = plant(branchy)({"h": lambda h: h * 10.0}, X2, jnp.bool_(pred))
    close(out, jnp.sin(X2) * 10 + 1.0 if pred else jnp.cos(X2) * 10 - 1.0)
    close(
        plant(branchy)(reap(branchy)(X2, jnp.bool_(pred)), X2, jnp.bool_(pred)),
        branchy(X2, jnp.bool_(pred)),
    )


@pytest.mark.parametrize("index", [0, 1, 2])
def test_switch_three_branches(index):
    def f(i, x):
        return lax.switch(
            i,
            [
                lambda x: sow(x * 1.0, name="s", mode="clobber"),
                lambda x: sow(x * 2.0, name="s", mode="clobber") + sow(x, name="t", mode="append"),
                lambda x: x * 3.0,
            ],
            x,
        )

    out, r = call_and_reap(f)(jnp.int32(index), X2)
    scale = [1.0, 2.0, 3.0][index]
    close(out, X2 * scale + (X2 if index == 1 else 0.0))
    s_expected = [X2, X2 * 2.0, jnp.zeros(2)][index]
    t_expected = (X2 if index == 1 else jnp.zeros(2))[None]
    close(r, {"s": s_expected, "t": t_expected})


def test_cond_inside_scan():
    def f(xs):
        def body(c, x):
            y = lax.cond(
                x[0] > 0,
                lambda x: sow(x * 2.0, name="y", mode="append"),
                lambda x: sow(-x, name="y", mode="append"),
                x,
            )
            return c + y, None

        return lax.scan(body, jnp.zeros(2), xs)[0]

    ys = jnp.stack([XS[i] * 2.0 if XS[i, 0] > 0 else -XS[i] for i in range(4)])
    out, r = call_and_reap(f)(XS)
    close(out, jnp.sum(ys, axis=0))
    close(r, {"y": ys})
    new = jnp.arange(8.0).reshape(4, 2)
    close(plant(f)({"y": new}, XS), jnp.sum(new, axis=0))


def test_clobber_not_touched_by_untaken_branch_keeps_earlier_value():
    def f(x, pred):
        sow(x, name="k", mode="clobber")
        return lax.cond(pred, lambda x: sow(x * 5.0, name="k", mode="clobber"), lambda x: x, x)

    close(reap(f)(X2, jnp.bool_(True)), {"k": X2 * 5.0})
    close(reap(f)(X2, jnp.bool_(False)), {"k": X2})


def test_append_plant_in_scan_ignores_same_name_of_another_tag():
    # Rows per iteration are counted for this tag only.
    def f(xs):
        def body(c, x):
            y = sow(x + 0.5 * c, name="y", mode="append")
            sow(y * 2.0, name="y", tag="other", mode="append")
            return c, y

        return lax.scan(body, 0.0, xs)[1]

    close(plant(f)({"y": jnp.arange(5.0) + 10.0}, jnp.zeros(5)), jnp.arange(5.0) + 10.0)


def test_zero_size_append_in_scan_keeps_its_shape():
    def f(xs):
        body = lambda c, x: (c + x, sow(jnp.zeros((0,)) * x, name="z", mode="append"))
        return lax.scan(body, 0.0, xs)[0]

    reaped = reap(f)(jnp.ones(4))
    assert reaped["z"].shape == (4, 0)
    # A scan around a scan multiplies the rows, still zero-size.
    outer = lambda xs: lax.scan(lambda c, x: (f(xs) + c, None), 0.0, None, length=2)[0]
    assert reap(outer)(jnp.ones(4))["z"].shape == (8, 0)


# n % 2 != 0 leaves a shorter remainder batch; n < 2 has only the remainder.
@pytest.mark.parametrize("mode", ["append", "clobber"])
@pytest.mark.parametrize("n", [1, 4, 5])
def test_lax_map_with_batch_size_reaps_and_plants_per_element_as_without(mode, n):
    # lax.map(batch_size=b) is a scan over a vmap of b elements plus a remainder.
    # Its sows are reaped and planted once per element, exactly as lax.map(f, xs)
    # without batch_size, the reference (itself checked by hand).
    def f(xs, batch_size):
        g = lambda x: jnp.sin(sow(x * 2.0, name="h", mode=mode)) + x  # noqa: E731
        return lax.map(g, xs, batch_size=batch_size)

    batched, unbatched = functools.partial(f, batch_size=2), functools.partial(f, batch_size=None)
    xs = jnp.arange(float(n)) / 3.0
    out, reaped = call_and_reap(batched)(xs)
    want_out, want = call_and_reap(unbatched)(xs)
    close((out, reaped), (want_out, want))
    close(want["h"], xs * 2.0 if mode == "append" else xs[-1] * 2.0)
    # sites lists each element's sow of a batch apart; together they fire once per element.
    assert sum(s.fires for s in sites(batched)(xs)) == sum(s.fires for s in sites(unbatched)(xs))
    plants = [
        {"h": jnp.float32(7.0)},  # one value for every element
        {"h": lambda old: old * 10.0},  # sees one element
        {"h": lambda old, i: old + i},  # the element's occurrence index
    ]
    if mode == "append":
        plants.append({"h": jnp.arange(n) * 100.0})  # a row per element
    for p in plants:
        close(plant(batched)(p, xs), plant(unbatched)(p, xs))
    close(plant(batched)(reaped, xs), plant(unbatched)(want, xs))
    if mode == "append":  # every row planted back: f itself (a clobber plant sets each one)
        close(plant(batched)(reaped, xs), batched(xs))
    close(jax.jit(plant(batched))({"h": jnp.float32(7.0)}, xs), jnp.sin(7.0) + xs)
    close(
        jax.grad(lambda xs: call_and_reap(batched)(xs)[1]["h"].sum())(xs),
        jax.grad(lambda xs: call_and_reap(unbatched)(xs)[1]["h"].sum())(xs),
    )


@pytest.mark.parametrize("mode", ["collect", "append", "clobber"])
@pytest.mark.parametrize("n", [1, 4, 5])
def test_reap_and_plant_of_vmap_over_a_lax_map_with_batch_size(mode, n):
    # The vmap around the map batches each element's sow (in its scan of full
    # batches, and in the remainder, which runs under the map's frames) as any sow:
    # hand-threaded, element i of example e sows sin(xs[e, i]) * 2 and returns it + 1.
    g = lambda x: sow(jnp.sin(x) * 2.0, name="s", mode=mode) + 1.0  # noqa: E731
    f = jax.vmap(lambda xs: lax.map(g, xs, batch_size=2))
    xs = jnp.arange(3.0 * n * 2).reshape(3, n, 2) / 7.0
    sown = jnp.moveaxis(jnp.sin(xs) * 2.0, 0, 1)  # [element, example, 2], as lax.map stacks
    rows = {"collect": (sown,), "append": sown, "clobber": sown[-1]}[mode]
    out, reaped = call_and_reap(f)(xs)
    close(out, jnp.sin(xs) * 2.0 + 1.0)
    close(reaped, {"s": rows})
    new = jnp.arange(sown.size, dtype=jnp.float32).reshape(sown.shape)
    if mode == "clobber":  # one value, planted at every element of every example
        close(plant(f)({"s": new[0]}, xs), jnp.broadcast_to(new[0][:, None], xs.shape) + 1.0)
    else:
        planted = (new,) if mode == "collect" else new
        close(plant(f)({"s": planted}, xs), jnp.moveaxis(new, 0, 1) + 1.0)


@pytest.mark.parametrize("mode", ["append", "clobber"])
def test_a_batched_lax_map_around_one_whose_elements_fit_its_remainder(mode):
    # The inner map runs only its remainder, under the outer map's vmap: each vmap
    # unrolls its own elements (only a vmap the user put around a map leaves them),
    # so the sows are reaped and planted as lax.map without batch_size, by hand.
    g = lambda x: sow(jnp.sin(x) * 2.0, name="s", mode=mode) + 1.0  # noqa: E731
    f = lambda xs: lax.map(lambda x: lax.map(g, x, batch_size=2), xs, batch_size=2)  # noqa: E731
    xs = jnp.arange(3.0).reshape(3, 1) / 5.0
    sown = (jnp.sin(xs) * 2.0).reshape(3)  # element (i, 0) sows row i
    close(reap(f)(xs), {"s": sown if mode == "append" else sown[-1]})
    new = jnp.array([10.0, 20.0, 30.0])
    planted = new if mode == "append" else new[0]
    close(plant(f)({"s": planted}, xs), jnp.broadcast_to(planted, (3,)).reshape(3, 1) + 1.0)


def test_lax_map_with_batch_size_a_sow_nested_in_a_jit_is_per_element_one_in_a_loop_refused():
    # JAX keeps no lax.map frame in the traceback of a sow nested in a body that
    # f traces (a jit, a scan): harvest finds it from the running stack.
    def f(xs, batch_size, inner):
        return lax.map(lambda x: inner(x) + x, xs, batch_size=batch_size)

    in_jit = jax.jit(lambda x: jnp.sin(sow(x * 2.0, name="h", mode="append")))
    xs = jnp.arange(5.0) / 3.0
    out, reaped = call_and_reap(f)(xs, 2, in_jit)
    close((out, reaped), (jnp.sin(xs * 2.0) + xs, {"h": xs * 2.0}))  # by hand
    by_index = {"h": lambda old, i: old + i}
    close(plant(f)(by_index, xs, 2, in_jit), plant(f)(by_index, xs, None, in_jit))
    # In a scan, each step runs for the whole batch: the rows would come step by
    # step (they did, silently: [x0 s0, x1 s0, x0 s1, ...]), so it is refused.

    def in_scan(x):
        step = lambda c, _: (sow(c * 0.75, name="h", mode="append"), None)  # noqa: E731
        return lax.scan(step, x, None, length=2)[0]

    for run in (lambda: reap(f)(xs, 2, in_scan), lambda: plant(f)(by_index, xs, 2, in_scan)):
        with pytest.raises(ValueError, match=r"name='h' runs in a loop.*batch_size=b.*without"):
            run()
    rows = reap(f)(xs, None, in_scan)["h"]  # without batch_size: element by element
    close(rows, jnp.stack([xs * 0.75, xs * 0.75**2], axis=1).ravel())


@pytest.mark.parametrize("n", [4, 5])  # two batches of 2; and a remainder of 1
def test_lax_map_with_batch_size_refuses_a_rows_name_sown_twice_per_element(n):
    # JAX runs g vmapped over a batch, so each sow fires for the whole batch before
    # the next: the rows would come sow by sow within a batch, not element by
    # element as lax.map(g, xs) gives them. Refused rather than silently reordered.
    def twice(x):
        y = sow(x * 2.0, name="h", mode="append")
        return sow(y + 1.0, name="h", mode="append")

    helper = jax.jit(lambda x: sow(x * 2.0, name="h", mode="append"))
    bodies = {
        "twice": twice,
        "twice, jitted": jax.jit(twice),
        "a jitted helper called twice": lambda x: helper(helper(x)),
        "twice in a cond's branch": lambda x: lax.cond(x > 1.0, twice, lambda y: y, x),
        "once, then once in a cond": lambda x: lax.cond(
            x > 1.0,
            lambda y: sow(y, name="h", mode="append"),
            lambda y: y,
            sow(x, name="h", mode="append"),
        ),
    }
    xs = jnp.arange(float(n))
    by_hand = jnp.stack([xs * 2.0, xs * 2.0 + 1.0], axis=1).ravel()  # element by element
    close(reap(lambda xs: lax.map(twice, xs))(xs), {"h": by_hand})
    plants = [
        {"h": by_hand},
        {"h": lambda old, i: old + 100.0 * i},
        {"h": lambda old: old * 10.0},
    ]
    for g in bodies.values():
        f = lambda xs, g=g: lax.map(g, xs, batch_size=2)  # noqa: E731
        message = r"(?s)name='h'.*more than once per element.*batch_size.*own name"
        with pytest.raises(ValueError, match=message):
            reap(f)(xs)
        for p in plants:
            with pytest.raises(ValueError, match=message):
                plant(f)(p, xs)
    # Once per element still works, and so does a name sown once in each branch
    # of a cond (one occurrence per element, whichever branch runs).
    once = lambda x: sow(x * 2.0, name="h", mode="append") + 1.0  # noqa: E731
    close(reap(lambda xs: lax.map(once, xs, batch_size=2))(xs), {"h": xs * 2.0})
    close(
        plant(lambda xs: lax.map(once, xs, batch_size=2))({"h": lambda old, i: 10.0 * i}, xs),
        jnp.arange(n) * 10.0 + 1.0,
    )
    branches = lambda x: lax.cond(  # noqa: E731
        x > 1.0,
        lambda y: sow(y, name="h", mode="append"),
        lambda y: sow(-y, name="h", mode="append"),
        x,
    )
    close(
        reap(lambda xs: lax.map(branches, xs, batch_size=2))(xs),
        {"h": jnp.where(xs > 1.0, xs, -xs)},
    )

    # The same with a predicate the vmap does not batch (not per element): still a cond.
    def unbatched(xs):
        up = lambda y: sow(y, name="h", mode="append")  # noqa: E731
        down = lambda y: sow(-y, name="h", mode="append")  # noqa: E731
        return lax.map(lambda x: lax.cond(xs.sum() < 0.0, up, down, x), xs, batch_size=2)

    close(reap(unbatched)(xs), {"h": -xs})


@pytest.mark.parametrize("n", [4, 5])  # two batches of 2; and a remainder of 1
def test_lax_map_with_batch_size_a_sow_in_a_cond_is_per_element_as_without(n):
    # vmap batches the cond's predicate, so it runs both branches; the taken
    # one's sows are recorded per element, as lax.map(f, xs) records them.
    def f(xs, batch_size, wrap=lambda g: g):
        branch = lambda y: sow(y * 2.0, name="a", mode="append") + 1.0  # noqa: E731
        g = lambda x: lax.cond(x > 1.0, branch, lambda y: y, x)  # noqa: E731
        return lax.map(wrap(g), xs, batch_size=batch_size)

    xs = jnp.arange(float(n))
    # By hand: 0 where the branch is not taken (a cond counts as its longest branch).
    rows = jnp.where(xs > 1.0, xs * 2.0, 0.0)
    close(call_and_reap(f)(xs, None), (jnp.where(xs > 1.0, xs * 2.0 + 1.0, xs), {"a": rows}))
    for wrap in (lambda g: g, jax.jit):  # in a jit in f, JAX's traceback shows no lax.map
        close(call_and_reap(f)(xs, 2, wrap), call_and_reap(f)(xs, None))
        plants = [
            {"a": lambda old, i: old + 100.0 * i},
            {"a": lambda old: old * 10.0},
            {"a": jnp.float32(7.0)},
            {"a": jnp.arange(n) * 100.0},
            {"a": rows},
        ]
        for p in plants:
            close(plant(f)(p, xs, 2, wrap), plant(f)(p, xs, None))
    close(plant(f)({"a": rows}, xs, 2), f(xs, None))  # reaped rows planted back: f itself


@pytest.mark.parametrize("n", [1, 4, 5])  # the remainder alone; no remainder; both
def test_lax_map_with_batch_size_collects_one_entry_per_sow_as_without(n):
    # lax.map(f, xs) is a scan: each collect sow in f gives one entry stacked over
    # the elements. With batch_size, f's sows run once per element of each batch
    # and of the remainder; their entries are merged into that one entry per sow.
    def f(xs, batch_size):
        def g(x):
            y = sow(jnp.stack([x, -x]), name="h")
            return sow(y * 3.0, name="h").sum() + sow(x + 1.0, name="k")

        return lax.map(g, xs, batch_size=batch_size)

    xs = jnp.arange(float(n)) / 3.0
    pairs = jnp.stack([xs, -xs], axis=1)
    by_hand = {"h": (pairs, pairs * 3.0), "k": (xs + 1.0,)}
    out, reaped = call_and_reap(f)(xs, None)
    close(reaped, by_hand)
    close(call_and_reap(f)(xs, 2), (out, by_hand))
    close(reap(f)(xs, 3), by_hand)

    # sites lists each element's sow of a batch apart; together they fire once per element.
    def fires(batch_size):
        counts = {}
        for s in sites(f)(xs, batch_size):
            counts[s.name] = counts.get(s.name, 0) + s.fires
        return counts

    assert fires(2) == fires(None) == {"h": 2 * n, "k": n}
    plants = [
        {"h": jnp.ones(2), "k": jnp.float32(7.0)},  # one value for every element
        {"h": lambda old: old * 10.0, "k": lambda old: old[::-1] if old.ndim else -old},
        {"h": (pairs + 1.0, pairs * 0.0), "k": (xs * 100.0,)},  # entry by entry
    ]
    for p in plants:
        close(plant(f)(p, xs, 2), plant(f)(p, xs, None))
    close(plant(f)(reaped, xs, 2), f(xs, None))  # reaped entries planted back: f itself
    # As without batch_size: an occurrence index means nothing in a scan's entry,
    # and a plant needs as many entries as reap gives.
    for batch_size in (None, 2):
        with pytest.raises(ValueError, match=r"name='h'.*occurrence index"):
            plant(f)({"h": lambda old, i: old + i}, xs, batch_size)
        with pytest.raises(ValueError, match=r"name='k'.*has 2 entries.*returns 1"):
            plant(f)({"k": (xs, xs)}, xs, batch_size)
    # Inside a scan around the map, its rows stay behind the scan's axis.
    twice = lambda xs, b: lax.scan(lambda c, _: (c, f(xs, b)), 0.0, None, length=2)[1]  # noqa: E731
    close(reap(twice)(xs, 2), reap(twice)(xs, None))
    close(reap(twice)(xs, None)["k"], (jnp.stack([xs + 1.0] * 2),))
    # Two maps sowing one name: each map's entries merge apart (the second has
    # fewer elements than a batch: its remainder alone).
    two = lambda xs, b: (f(xs, b), f(xs[:1], b))  # noqa: E731
    if n == 4:  # the first without a remainder, the second with both parts
        four_then_five = lambda xs, b: (f(xs, b), f(jnp.append(xs, 9.0), b))  # noqa: E731
        close(reap(four_then_five)(xs, 2), reap(four_then_five)(xs, None))
    both = {"h": (pairs, pairs * 3.0, pairs[:1], pairs[:1] * 3.0), "k": (xs + 1.0, xs[:1] + 1.0)}
    close(reap(two)(xs, 2), both)
    entries = {"k": (xs * 100.0, xs[:1] - 5.0)}
    close(plant(two)(entries, xs, 2), plant(two)(entries, xs, None))
    # In a cond whose predicate vmap batches: the taken branch's value, 0 elsewhere.

    def in_cond(xs, batch_size):
        branch = lambda y: sow(y * 2.0, name="a") + 1.0  # noqa: E731
        g = lambda x: lax.cond(x > 0.5, branch, lambda y: y, x)  # noqa: E731
        return lax.map(g, xs, batch_size=batch_size)

    for batch_size in (None, 2):
        close(reap(in_cond)(xs, batch_size), {"a": (jnp.where(xs > 0.5, xs * 2.0, 0.0),)})
        close(
            plant(in_cond)({"a": (xs * 10.0,)}, xs, batch_size),
            jnp.where(xs > 0.5, xs * 10.0 + 1.0, xs),
        )


def _while_per_example(x):
    # Each example loops its own number of times; "ran" sows a value that is
    # the same for every example, yet is set only where the loop ran.
    def body(c):
        i, v = c
        sow(v, name="last", mode="clobber")
        sow(i, name="step", mode="clobber")
        sow(jnp.ones(2), name="ran", mode="clobber")
        sow_cond(v, v > 2.0, name="big")
        return i + 1.0, v * 1.5 + 1.0

    return lax.while_loop(lambda c: c[1] < 4.0, body, (jnp.float32(0.0), x))


def test_reap_plant_nest_of_vmap_of_a_while_with_a_batched_predicate():
    xs = jnp.array([0.0, 1.0, 2.5, 5.0], jnp.float32)
    expected = jax.vmap(call_and_reap(_while_per_example))(xs)  # reference: per example
    close(call_and_reap(jax.vmap(_while_per_example))(xs), expected)
    close(reap(jax.vmap(_while_per_example))(xs), expected[1])
    # Planting replaces the value at every iteration, per example.
    planted = jax.vmap(lambda x: plant(_while_per_example)({"last": lambda v: v + 0.5}, x))(xs)
    close(plant(jax.vmap(_while_per_example))({"last": lambda v: v + 0.5}, xs), planted)
    # nest re-emits the sows with a scope, under the same loop.
    nested = nest(jax.vmap(_while_per_example), scope="s")
    close(nested(xs), jax.vmap(_while_per_example)(xs))
    close(reap(nested)(xs), {"s": expected[1]})
    close(jax.jit(reap(jax.vmap(_while_per_example)))(xs), expected[1])


def test_collect_plant_round_trip_when_a_later_entry_has_more_axes():
    # The scan's entry is stacked [3, 2]; the entry after it comes from a vmap, [2, 2]:
    # only the scan's own entries are sliced per iteration.
    def f(x):
        x = lax.scan(lambda c, _: (sow(jnp.sin(c), name="h") + 0.1, None), x, None, length=3)[0]
        return jnp.sum(jax.vmap(lambda r: sow(r * 2.0, name="h"))(jnp.stack([x, -x])), axis=0)

    x = jnp.array([0.5, -1.0])
    reaped = reap(f)(x)
    assert [e.shape for e in reaped["h"]] == [(3, 2), (2, 2)]
    close(plant(f)(reaped, x), f(x))
    planted = (jnp.ones((3, 2)), jnp.full((2, 2), 5.0))
    close(plant(f)({"h": planted}, x), jnp.full(2, 10.0))  # by hand: the vmap's entry, summed


def test_clobber_carried_into_a_loop_with_another_shape():
    def f(x):
        sow(x, name="last", mode="clobber")  # shape [2]
        body = lambda c, _: (c, sow(jnp.sum(c), name="last", mode="clobber"))  # shape []
        return lax.scan(body, x, None, length=2)[0]

    with pytest.raises(
        ValueError, match=r"(?s)name='last'.*shape \[2\] before this scan.*shape \[\]"
    ):
        reap(f)(jnp.ones(2))

    # Sown unbatched before the loop and per example inside it: broadcast, as vmap would.
    def g(xs):
        sow(jnp.float32(-1.0), name="last", mode="clobber")
        body = lambda c, _: (c + 1.0, sow(c, name="last", mode="clobber"))
        return jax.vmap(lambda x: lax.scan(body, x, None, length=0)[0])(xs)

    close(reap(g)(jnp.arange(3.0))["last"], jnp.full(3, -1.0))


# ---------------------------------------------------------------------------
# A planted callable that takes the occurrence index


def indexed_program(xs):
    """'h' fires once before a scan, twice per iteration of a 3-step scan whose
    body holds a 2-step scan, and once after: 1 + 3 * (1 + 2) + 1 = 11 rows.
    Every sown value reaches the output, so planting `index` shows which
    index each occurrence saw."""
    first = sow(xs[0], name="h", mode="append")

    def inner(c, x):
        return c, sow(x, name="h", mode="append")

    def outer(c, x):
        a = sow(x, name="h", mode="append")
        _, bs = lax.scan(inner, c, jnp.stack([x, x]))
        return c, jnp.concatenate([a[None], bs])

    _, mid = lax.scan(outer, 0.0, xs)
    last = sow(xs[-1], name="h", mode="append")
    return jnp.concatenate([first[None], mid.reshape(-1), last[None]])


def test_a_planted_callable_sees_the_occurrence_index_as_reap_stacks_rows():
    xs = jnp.arange(3.0)
    rows = reap(indexed_program)(xs)["h"]
    assert rows.shape == (11,)
    got = plant(indexed_program)({"h": lambda old, i: 0.0 * old + i}, xs)
    np.testing.assert_array_equal(got, jnp.arange(11.0))  # row j of reap is occurrence j
    jitted = jax.jit(
        lambda xs: plant(indexed_program)({"h": lambda old, i: old + 100.0 * (i == 5)}, xs)
    )
    want = rows.at[5].add(100.0)  # only occurrence 5 moved: iteration 1's inner step 0
    np.testing.assert_array_equal(jitted(xs), want)

    # harvest: the same index, while the unplanted names are reaped.
    def two(xs):
        return sow(indexed_program(xs).sum(), name="total", mode="strict")

    out, reaps = harvest(two)({"h": lambda old, i: jnp.where(i % 2 == 0, old, 0.0)}, xs)
    np.testing.assert_allclose(
        reaps["total"], jnp.sum(jnp.where(jnp.arange(11) % 2 == 0, rows, 0.0))
    )
    # A callable with a defaulted second parameter is a callable of the old value alone.
    np.testing.assert_array_equal(
        plant(indexed_program)({"h": lambda old, i=7.0: old + i}, xs), rows + 7.0
    )


def test_an_indexed_plant_in_a_reversed_scan_and_bad_places():
    def rev(xs):
        return lax.scan(lambda c, x: (c, sow(x, name="h", mode="append")), 0.0, xs, reverse=True)[1]

    xs = jnp.arange(4.0)
    np.testing.assert_array_equal(
        plant(rev)({"h": lambda old, i: 0.0 * old + i}, xs), jnp.arange(4.0)
    )

    def collected(xs):
        return lax.scan(lambda c, x: (c + sow(x, name="h"), None), 0.0, xs)[0]

    with pytest.raises(ValueError, match="takes an occurrence index.*'collect' inside a loop"):
        plant(collected)({"h": lambda old, i: old}, xs)

    def looped(x):
        return lax.while_loop(
            lambda c: c < 3.0, lambda c: sow(c, name="h", mode="clobber") + 1.0, x
        )

    # In a while_loop the index counts iterations: h=0+0 -> c=1, h=1+1 -> c=3.
    assert float(plant(looped)({"h": lambda old, i: old + i}, 0.0)) == 3.0
    assert float(plant(looped)({"h": lambda old: old + 1.0}, 0.0)) == 4.0


# An index plant counts a while_loop's occurrences for the sows after it, as
# many as the loop ran (known only when it runs).


def _doubling(x):
    """Sows "a" once before, once per iteration of a while_loop, once after."""
    x = sow(x, name="a", mode="append")
    x = lax.while_loop(lambda c: c < 10.0, lambda c: sow(c * 2.0, name="a", mode="append"), x)
    return sow(x + 1.0, name="a", mode="append")


def _doubling_by_hand(x, shift, start=0):
    """`_doubling` with occurrence `i` of "a" replaced by `shift(old, i)`, threaded
    by hand, counting from `start`; and the number of occurrences."""
    i = start
    x = shift(x, i)
    i += 1
    while x < 10.0:
        x = shift(x * 2.0, i)
        i += 1
    return shift(x + 1.0, i), i + 1 - start


SHIFT = lambda old, i: old + 0.25 * i


@pytest.mark.parametrize("x", [20.0, 1.0, 0.5, 0.125])
def test_an_index_plant_after_a_while_loop_counts_its_iterations(x):
    want = _doubling_by_hand(x, SHIFT)[0]
    planted = plant(_doubling)
    assert float(planted({"a": SHIFT}, x)) == want
    assert float(jax.jit(lambda x: planted({"a": SHIFT}, x))(x)) == want


def test_an_index_plant_counts_a_while_loop_inside_jit_scan_and_while():
    in_jit = lambda x: jax.jit(_doubling)(x) * 1.0
    assert float(plant(in_jit)({"a": SHIFT}, 0.5)) == _doubling_by_hand(0.5, SHIFT)[0]

    def scanned(xs):  # iteration t starts after every row the earlier ones gave
        return lax.scan(lambda c, x: (c, _doubling(x)), 0.0, xs)[1]

    xs = [20.0, 1.0, 0.5, 0.125]
    want, before = [], 0
    for x in xs:
        y, n = _doubling_by_hand(x, SHIFT, before)
        want.append(y)
        before += n
    np.testing.assert_array_equal(plant(scanned)({"a": SHIFT}, jnp.array(xs)), want)

    def nested(x):  # a while_loop in a while_loop's body
        def body(c):
            inner = lambda d: sow(d + 1.0, name="a", mode="append")
            return lax.while_loop(lambda d: d < c + 3.0, inner, c) * 2.0

        return sow(lax.while_loop(lambda c: c < 20.0, body, x), name="a", mode="append")

    def nested_by_hand(x):
        i = 0
        while x < 20.0:
            d = x
            while d < x + 3.0:
                d = d + 1.0 + 0.25 * i
                i += 1
            x = d * 2.0
        return x + 0.25 * i

    for x in (1.0, 25.0):
        assert float(plant(nested)({"a": SHIFT}, x)) == nested_by_hand(x)


def test_an_index_plant_of_a_while_loop_inside_a_cond_is_an_error():
    def branchy(x):
        return lax.cond(x > 0, _doubling, lambda x: x, x) + sow(x, name="a", mode="append")

    with pytest.raises(ValueError, match="while_loop within a cond.*callable old -> new"):
        plant(branchy)({"a": SHIFT}, 1.0)
    assert float(plant(branchy)({"a": lambda old: old + 1.0}, 1.0)) == 15.0


def test_an_index_plant_of_a_site_outside_a_scan_leaves_the_scan_alone():
    def f(x):
        x = sow(x, name="a")

        def body(c, _):
            return sow(c, name="b", mode="append") * 2.0, None

        return lax.scan(body, x, None, length=3)[0]

    close(plant(f)({"a": lambda old, i: old + 1.0}, 1.0), 16.0)
