"""reap/plant through jit, closed_call, vmap and remat."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import close
from jax import lax

from harvest import _jax, call_and_reap, harvest, plant, reap, sow, sow_cond
from harvest.compat import oryx

X = jnp.array([0.5, -1.0, 2.0], jnp.float32)
XB = jnp.stack([X, X * 2.0 - 1.0])  # batch of 2


def layer(x):
    h = sow(jnp.tanh(x), name="h", mode="collect")
    return h * 2.0 + 1.0


def ref_layer(x):
    h = jnp.tanh(x)
    return h * 2.0 + 1.0, h


# ---------------------------------------------------------------------------
# jit


def test_plain_jit_runs_unchanged():
    f = jax.jit(lambda x: layer(layer(x)))
    y1, h1 = ref_layer(X)
    y2, h2 = ref_layer(y1)
    close(f(X), y2)


def test_nested_jit_reap_and_plant():
    @jax.jit
    def inner(x):
        return layer(x)

    @jax.jit
    def outer(x):
        y = inner(x)
        a = sow(y * y, name="sq", mode="strict")
        return jax.jit(inner)(a)

    y1, h1 = ref_layer(X)
    a = y1 * y1
    y2, h2 = ref_layer(a)
    out, r = call_and_reap(outer)(X)
    close(out, y2)
    close(r, {"h": (h1, h2), "sq": a})
    # plant into the doubly nested jit
    v1, v2 = jnp.full(3, 0.5), jnp.full(3, -0.25)
    a_p = (v1 * 2 + 1) ** 2
    close(plant(outer)({"h": (v1, v2)}, X), v2 * 2 + 1)
    close(plant(outer)({"sq": jnp.ones(3)}, X), jnp.tanh(jnp.ones(3)) * 2 + 1)
    del a_p
    # jit outside reap
    close(jax.jit(reap(outer))(X), {"h": (h1, h2), "sq": a})
    close(jax.jit(plant(outer))({"h": (v1, v2)}, X), v2 * 2 + 1)


def test_jit_with_static_args_and_kwargs():
    @functools.partial(jax.jit, static_argnums=1)
    def f(x, n):
        for _ in range(n):
            x = sow(x * 2.0, name="d", mode="append")
        return x

    close(reap(lambda x: f(x, 3))(X), {"d": jnp.stack([X * 2, X * 4, X * 8])})


def test_closed_call():
    def body(x):
        return layer(x) * 3.0

    def f(x):
        closed = jax.make_jaxpr(body)(x)
        return _jax.bind_with(_jax.closed_call_p, {"call_jaxpr": closed}, [x])[0]

    # confirm the test exercises closed_call
    assert any(e.primitive is _jax.closed_call_p for e in jax.make_jaxpr(f)(X).jaxpr.eqns)
    y, h = ref_layer(X)
    out, r = call_and_reap(f)(X)
    close(out, y * 3.0)
    close(r, {"h": (h,)})
    v = jnp.array([1.0, 0.0, -1.0])
    close(plant(f)({"h": (v,)}, X), (v * 2 + 1) * 3.0)


def test_reap_is_cached_and_consistent():
    f = reap(layer)
    r1 = f(X)
    r2 = f(X + 0.0)
    close(r1, r2)
    close(f(X * 2), {"h": (jnp.tanh(X * 2),)})
    # a different shape retraces and still works
    close(f(X[:2]), {"h": (jnp.tanh(X[:2]),)})


# ---------------------------------------------------------------------------
# vmap


def test_vmap_of_reap():
    def f(x):
        a = sow(jnp.sin(x), name="a", mode="strict")
        b = sow(jnp.sum(a), name="b", mode="append")
        return a * b

    r = jax.vmap(reap(f))(XB)
    close(r, {"a": jnp.sin(XB), "b": jnp.sum(jnp.sin(XB), axis=1)[:, None]})
    v = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    close(jax.vmap(plant(f))({"a": v}, XB), v * jnp.sum(v, axis=1, keepdims=True))


def test_reap_of_vmap_batch_axis_leading():
    def f(x):
        a = sow(jnp.sin(x), name="a", mode="strict")
        s = sow(jnp.sum(a), name="s", mode="collect")
        # a sow of an unbatched value inside vmap
        c = sow(jnp.float32(2.0), name="c", mode="strict")
        return a * s * c

    out, r = call_and_reap(jax.vmap(f))(XB)
    a = jnp.sin(XB)
    s = jnp.sum(a, axis=1)
    close(out, a * s[:, None] * 2.0)
    close(r["a"], a)
    close(r["s"], (s,))
    # an unbatched sown value stays unbatched (sow never changes what vmap sees)
    close(r["c"], jnp.float32(2.0))
    # planting expects the same batched layout
    v = jnp.ones((2, 3))
    close(plant(jax.vmap(f))({"a": v}, XB), v * 3.0 * 2.0)


def test_reap_of_vmap_in_axes_not_zero():
    def f(x):
        return sow(x * 2.0, name="y", mode="strict")

    xt = XB.T  # (3, 2): batch on axis 1
    r = reap(jax.vmap(f, in_axes=1))(xt)
    close(r, {"y": XB * 2.0})


def test_vmap_reap_of_vmap_nested():
    def f(x):
        return sow(x + 1.0, name="y", mode="strict") * 2.0

    xs = jnp.arange(12.0).reshape(2, 2, 3)
    close(jax.vmap(reap(jax.vmap(f)))(xs), {"y": xs + 1.0})
    close(reap(jax.vmap(jax.vmap(f)))(xs), {"y": xs + 1.0})


# ---------------------------------------------------------------------------
# remat


POLICIES = {
    "default": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}

W = jnp.array([[1.0, -0.5, 0.2], [0.3, 0.8, -1.0], [0.0, 0.5, 0.5]], jnp.float32)


def remat_block(policy):
    @functools.partial(jax.checkpoint, policy=policy)
    def block(x):
        h = sow(jnp.tanh(W @ x), name="h", mode="strict")
        return sow(jnp.sin(h) * x, name="o", mode="collect")

    return block


def ref_block(x, h=None):
    h0 = jnp.tanh(W @ x)
    h = h0 if h is None else h
    return jnp.sin(h) * x, h0


@pytest.mark.parametrize("pname", list(POLICIES))
def test_remat_reap_plant(pname):
    block = remat_block(POLICIES[pname])
    out, h = ref_block(X)
    o, r = call_and_reap(block)(X)
    close(o, out)
    close(r, {"h": h, "o": (out,)})
    v = jnp.array([0.1, 0.2, 0.3])
    close(plant(block)({"h": v}, X), ref_block(X, v)[0])


@pytest.mark.parametrize("pname", list(POLICIES))
def test_remat_under_grad_strict_site_not_sown_twice(pname):
    block = remat_block(POLICIES[pname])

    def loss(x):
        return jnp.sum(block(x) ** 2)

    def ref_loss(x):
        return jnp.sum(ref_block(x)[0] ** 2)

    g, r = call_and_reap(jax.grad(loss))(X)
    close(g, jax.grad(ref_loss)(X))
    out, h = ref_block(X)
    close(r, {"h": h, "o": (out,)})
    # grad of a planted remat block == grad of the hand-written function of the plant
    v = jnp.array([0.1, 0.2, 0.3])
    gp = jax.grad(lambda x: jnp.sum(plant(block)({"h": v}, x) ** 2))(X)
    close(gp, jax.grad(lambda x: jnp.sum(ref_block(x, v)[0] ** 2))(X))
    # grad w.r.t. the planted value
    gv = jax.grad(lambda v: jnp.sum(plant(block)({"h": v}, X) ** 2))(v)
    close(gv, jax.grad(lambda v: jnp.sum(ref_block(X, v)[0] ** 2))(v))


def test_grad_of_reap_through_remat():
    block = remat_block(None)
    g = jax.grad(lambda x: jnp.sum(reap(block)(x)["h"]))(X)
    close(g, jax.grad(lambda x: jnp.sum(jnp.tanh(W @ x)))(X))


def test_harvest_under_jit_and_vmap():
    def f(x):
        a = sow(x * 2.0, name="a", mode="strict")
        return sow(a + 1.0, name="b", mode="strict") * 3.0

    out, r = jax.jit(jax.vmap(harvest(f), in_axes=(None, 0)))({"a": jnp.ones(3)}, XB)
    close(out, jnp.full((2, 3), 6.0))
    close(r, {"b": jnp.full((2, 3), 2.0)})


def test_reap_of_vmap_of_scan_layouts():
    # vmap(reap(f)) leads with the batch axis; reap(vmap(f)) reaps the vmapped
    # program, whose scan stacks per-iteration batched values: iterations lead.
    def f(x):
        def body(c, xi):
            return c + sow(c * xi, name="v", mode="append"), None

        return lax.scan(body, 1.0, x)[0]

    rows = []
    for b in range(2):
        c, vs = 1.0, []
        for i in range(3):
            vs.append(c * XB[b, i])
            c = c + vs[-1]
        rows.append(jnp.stack(vs))
    expect = jnp.stack(rows)  # (batch, iterations)
    close(jax.vmap(reap(f))(XB), {"v": expect})
    close(reap(jax.vmap(f))(XB), {"v": expect.T})


def test_vmap_of_reap_of_cond_with_batched_predicate():
    # Per batch member, the taken branch's value; zeros where not taken. (JAX
    # runs both branches of the batched cond in reap(vmap(f)); harvest still
    # records only the taken one: tests/test_batched_cond.py.)
    def f(x):
        return lax.cond(
            x[0] > 0, lambda x: sow(x * 2.0, name="b", mode="collect"), lambda x: x - 1.0, x
        )

    xb = jnp.array([[1.0, 2.0], [-1.0, 3.0]])
    expect_out = jnp.stack([xb[0] * 2.0, xb[1] - 1.0])
    expect_b = (jnp.stack([xb[0] * 2.0, jnp.zeros(2)]),)
    close(jax.vmap(call_and_reap(f))(xb), (expect_out, {"b": expect_b}))
    close(call_and_reap(jax.vmap(f))(xb), (expect_out, {"b": expect_b}))


def test_vmap_of_reap_of_cond_clobber_keeps_earlier_value_where_not_taken():
    def f(x):
        sow(x, name="k", mode="clobber")
        return lax.cond(x[0] > 0, lambda x: sow(x * 5.0, name="k", mode="clobber"), lambda x: x, x)

    xb = jnp.array([[1.0, 2.0], [-1.0, 3.0]])
    expect = jnp.stack([xb[0] * 5.0, xb[1]])
    close(jax.vmap(reap(f))(xb), {"k": expect})


def test_sow_cond_with_a_batched_predicate_agrees_both_ways_round_vmap():
    # The predicate is per example, so the reaped value is too, whichever side
    # of vmap the harvest is on; an unbatched value becomes per example.
    xb = jnp.array([[1.0, 2.0], [-1.0, -3.0]])
    doubled = lambda x: sow_cond(x * 2.0, x.sum() > 0, name="c")
    expect = jnp.array([[2.0, 4.0], [0.0, 0.0]])
    close(reap(jax.vmap(doubled))(xb), {"c": expect})
    close(jax.vmap(reap(doubled))(xb), {"c": expect})
    close(
        plant(jax.vmap(doubled))({"c": jnp.zeros((2, 2))}, xb),
        jnp.array([[0.0, 0.0], [-2.0, -6.0]]),
    )

    constant = lambda x: sow_cond(jnp.arange(3.0), x.sum() > 0, name="k") + x.sum()
    expect = jnp.array([[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]])
    close(reap(jax.vmap(constant))(xb), {"k": expect})
    close(jax.vmap(reap(constant))(xb), {"k": expect})


@pytest.mark.parametrize("make", [plant, harvest, oryx.plant, oryx.harvest])
def test_jit_static_and_donated_arguments_of_planted_functions(make):
    # plant(f) is called as g(plants, x, n): argument 2 and the name "n" are n.
    def f(x, n):
        return sow(x * n, name="h", tag="t", mode="strict") + x * n

    g = make(f, tag="t")
    assert list(inspect.signature(g).parameters) == ["plants", "x", "n"]
    first = lambda out: out[0] if make in (harvest, oryx.harvest) else out
    x = jnp.arange(3.0)
    by_num = jax.jit(g, static_argnums=2)
    by_name = jax.jit(g, static_argnames="n")
    for jitted in (by_num, by_name):
        close(first(jitted({}, x, 2)), x * 4)  # reference: f by hand
        close(first(jitted({"h": jnp.ones(3)}, x, 3)), 1.0 + x * 3)

    # Donating "x" donates x, never the planted dict's arrays.
    donating = jax.jit(g, donate_argnames="x")
    planted, x = jnp.full(3, 7.0), jnp.arange(3.0) + 1.0
    close(first(donating({"h": planted}, x, 1.0)), jnp.array([8.0, 9.0, 10.0]))
    assert x.is_deleted() and not planted.is_deleted()


def test_planted_signature_keeps_a_user_argument_named_plants():
    g = plant(lambda plants, x: sow(plants * x, name="h") * 1.0)
    assert list(inspect.signature(g).parameters) == ["_plants", "plants", "x"]
    close(g({"h": (jnp.float32(5.0),)}, 2.0, 3.0), jnp.float32(5.0))


def test_plant_one_value_for_every_example_of_a_vmap_inside_f():
    # Reference: the same function with the planted value written in by hand.
    f = lambda x: sow(x * 2.0, name="h", mode="strict") * 3.0
    xs = jnp.arange(4.0)
    close(plant(jax.vmap(f))({"h": 5.0}, xs), jax.vmap(lambda x: 5.0 * 3.0 + 0.0 * x)(xs))
    g = lambda x: sow_cond(x * 2.0, x > 1.0, name="h") * 3.0
    close(plant(jax.vmap(g))({"h": 5.0}, xs), jnp.where(xs > 1.0, 15.0, xs * 6.0))
    rows = jnp.ones((4, 3))
    close(plant(jax.vmap(f))({"h": jnp.arange(3.0)}, rows), jnp.tile(jnp.arange(3.0) * 3.0, (4, 1)))
    # Nested vmaps: one value for both batch axes, or one per outer example.
    close(
        plant(jax.vmap(jax.vmap(f)))({"h": jnp.float32(1.0)}, jnp.ones((2, 4))),
        jnp.full((2, 4), 3.0),
    )
    per_row = jnp.arange(4.0)
    close(
        plant(jax.vmap(jax.vmap(f)))({"h": per_row}, jnp.ones((2, 4))),
        jnp.tile(per_row * 3.0, (2, 1)),
    )
    # Only vmap's axes may be left out: a wrong per-example shape still says both.
    with pytest.raises(
        ValueError,
        match=r"float32\[2\].*expects float32\[4, 3\] \(or float32\[3\] for every example",
    ):
        plant(jax.vmap(f))({"h": jnp.arange(2.0)}, rows)
    # Outside vmap a value still must have the sown shape.
    with pytest.raises(ValueError, match=r"is float32\[\], but the site expects float32\[4\]\. "):
        plant(f)({"h": 5.0}, xs)


def test_a_python_number_planted_into_a_site_of_another_dtype_takes_its_dtype():
    """As oryx's test_should_plant_constant: a Python float into a site sown from a
    Python int. It is cast as JAX casts in `x.at[i].set(15.0)`, and keeps the site's
    weak type, so loop carries keep their types (vmap of a while loop included).
    A fraction, which the cast would truncate, is refused (tests/test_errors.py)."""

    def f(x):
        return sow(x, name="x", mode="strict") + sow(717, name="y", mode="strict")

    assert float(plant(f)({"x": 2.0, "y": 15.0}, 1.0)) == 17.0
    with pytest.raises(ValueError, match=r"(?s)'y'.*15\.5 is no whole number"):
        plant(f)({"y": 15.5}, 1.0)  # oryx kept 15.5; the cast would give int32 15

    def loop(x, n):
        def body(c):
            i, v = c
            return i + 1, v + sow(i, name="i", mode="clobber")

        return lax.while_loop(lambda c: c[0] < n, body, (0, x))

    def by_hand(x, n, planted):  # the same loop with the planted value in place of i
        return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] + planted), (0, x))

    xs, ns = jnp.arange(3.0), jnp.array([1, 2, 3])
    got = jax.vmap(lambda x, n: plant(loop)({"i": 2.0}, x, n))(xs, ns)
    want = jax.vmap(lambda x, n: by_hand(x, n, 2))(xs, ns)
    assert jax.tree_util.tree_map(lambda a: (a.dtype, a.weak_type), got) == jax.tree_util.tree_map(
        lambda a: (a.dtype, a.weak_type), want
    )
    np.testing.assert_array_equal(got[1], want[1])

    def scan_carry(xs):
        return lax.scan(lambda c, x: (sow(c, name="c", mode="clobber") + 1, x * c), 0, xs)

    carry, ys = plant(scan_carry)({"c": 5.0}, jnp.arange(3.0))
    assert int(carry) == 6 and ys.tolist() == [
        0.0,
        6.0,
        12.0,
    ]  # x times the unplanted carry: 0, 6, 6
    cond_out = plant(lambda p, x: lax.cond(p, lambda x: x + sow(1, name="k"), lambda x: x, x))(
        {"k": 4.0}, True, 1.0
    )
    assert float(cond_out) == 5.0
    # Only Python numbers: an array of another dtype is still an error.
    with pytest.raises(ValueError, match=r"is float32\[\], but the site expects int32\[\]"):
        plant(f)({"y": jnp.float32(15.0)}, 1.0)


def test_one_walk_of_several_tags_plants_and_reaps_each_by_tag_and_name():
    from harvest._calling._transforms import harvest_tags

    def f(xs):
        def step(c, x):
            a = sow(x * 2.0, tag="a", name="h", mode="append")
            b = sow(a + c, tag="b", name="h", mode="append")  # the same name, another tag
            return sow(b, tag="c", name="carry", mode="clobber"), None

        return lax.scan(step, 0.0, xs)[0]

    xs = jnp.arange(3.0)
    walk = harvest_tags(f, ("a", "b"))
    out, reaps = jax.jit(walk)({"a": {"h": -xs}}, xs)
    # By hand: a = -x planted, b = a + c carried; the tag "c" passes through, unreaped.
    expected_b = jnp.array([0.0, -1.0, -3.0])
    assert sorted(reaps) == ["b"]
    np.testing.assert_allclose(reaps["b"]["h"], expected_b)
    np.testing.assert_allclose(out, expected_b[-1])
    assert reap(lambda x: walk({}, x)[0], tag="c")(xs)["carry"] == f(xs)
    # The same as one harvest per tag, nested.
    nested = call_and_reap(lambda x: harvest(f, tag="a")({"h": -xs}, x)[0], tag="b")(xs)
    np.testing.assert_allclose(nested[1]["h"], reaps["b"]["h"])
    with pytest.raises(KeyError, match="Cannot plant 'nope': no sow site of tag 'a'.*'h'"):
        walk({"a": {"nope": 1.0}}, xs)


# ---------------------------------------------------------------------------
# Planting back what reap returned (docs/semantics.md, "Planting back what reap returned")


def _looped(mode):
    def f(x):
        def body(c, _):
            return c * 2.0 + sow(c, name="h", mode=mode), None

        return lax.scan(body, x, None, length=3)[0]

    return f


def _sown_twice(mode):
    def f(x):
        first = sow(x, name="h", mode=mode)
        return first + sow(first * 2.0, name="h", mode=mode)

    return f


def _fori(mode):
    def f(x):
        return lax.fori_loop(0, 3, lambda i, v: v * 2.0 + sow(v, name="h", mode=mode), x)

    return f


@pytest.mark.parametrize("make", [_looped, _sown_twice, _fori])
@pytest.mark.parametrize("mode", ["collect", "append"])
def test_planting_back_every_occurrence_gives_f(make, mode):
    f = make(mode)
    close(plant(f)(reap(f)(X), X), f(X))


def test_planting_back_a_clobber_sown_once_gives_f():
    def f(x):
        return sow(x * 3.0, name="h", mode="clobber") + 1.0

    close(plant(f)(reap(f)(X), X), f(X))


@pytest.mark.parametrize("make", [_looped, _fori])
def test_planting_back_a_clobber_in_a_loop_does_not_give_f(make):
    # By hand: c <- 2c + h with h = c is c <- 3c, so f(x) = 27x; reap keeps the last
    # occurrence, h = c2 = 9x; planted at every iteration, c <- 2c + 9x: 11x, 31x, 71x.
    f, x = make("clobber"), np.asarray(X)
    close(f(X), 27.0 * x)
    close(reap(f)(X)["h"], 9.0 * x)
    close(plant(f)(reap(f)(X), X), 71.0 * x)


def test_planting_back_a_clobber_sown_twice_does_not_give_f():
    # By hand: f(x) = x + 2x; reap keeps the last, 2x; planted at both: 2x + 2x.
    f, x = _sown_twice("clobber"), np.asarray(X)
    close(f(X), 3.0 * x)
    close(reap(f)(X)["h"], 2.0 * x)
    close(plant(f)(reap(f)(X), X), 4.0 * x)
