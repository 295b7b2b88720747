"""Reap and plant across 8 virtual CPU devices: shard_map, sharded jit, pmap.

References are the same computations on one device, by hand.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from harvest import attribution_patching, call_and_reap, patching_sweep, plant, reap, sites, sow

assert jax.device_count() == 8, "run through tests/test_many_devices.py"

MESH = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
X = jnp.arange(64.0).reshape(8, 8) / 10.0


def sharded(f):
    return jax.shard_map(f, mesh=MESH, in_specs=P("x", "y"), out_specs=P("x"))


def body(x):
    h = sow(jnp.sin(x), name="h", mode="strict")
    total = jax.lax.psum(h, "y")
    sow(total.sum(), name="row_total")
    return total


def test_shard_map_reaps_per_shard_values_stacked_in_mesh_order():
    out, reaps = call_and_reap(sharded(body))(X)
    np.testing.assert_allclose(out, sharded(body)(X), rtol=1e-6)
    # Shard (i, j) holds the block X[2i:2i+2, 4j:4j+4]; rows are in mesh order.
    blocks = np.stack(
        [np.sin(X[2 * i : 2 * i + 2, 4 * j : 4 * j + 4]) for i in range(4) for j in range(2)]
    )
    np.testing.assert_allclose(reaps["h"], blocks, rtol=1e-6)
    totals = np.stack(
        [
            np.sin(X[2 * i : 2 * i + 2]).reshape(2, 2, 4).sum((1,)).sum()
            for i in range(4)
            for _ in range(2)
        ]
    )
    (row_total,) = reaps["row_total"]
    np.testing.assert_allclose(row_total, totals, rtol=1e-5)


def test_shard_map_reaped_values_stay_sharded():
    reaps = jax.jit(reap(sharded(body)))(X)
    sharding = reaps["h"].sharding
    assert isinstance(sharding, NamedSharding)
    assert sharding.spec[0] == ("x", "y")  # one row per device, nothing gathered


def test_shard_map_plant_single_value_and_per_shard_stack():
    zero = plant(sharded(body))({"h": jnp.zeros((2, 4))}, X)
    np.testing.assert_allclose(zero, np.zeros((8, 4)))
    per_shard = jnp.arange(8.0)[:, None, None] * jnp.ones((8, 2, 4))
    out = plant(sharded(body))({"h": per_shard}, X)
    expected = np.concatenate([np.full((2, 4), 2 * i + (2 * i + 1)) for i in range(4)])
    np.testing.assert_allclose(out, expected)


def test_grad_through_reaped_shard_map_matches_single_device():
    def loss(x):
        return call_and_reap(sharded(body))(x)[1]["h"].sum()

    np.testing.assert_allclose(jax.grad(loss)(X), np.cos(X), rtol=1e-6)


def test_sharded_jit_keeps_output_sharding():
    spec = NamedSharding(MESH, P("x", "y"))
    f = jax.jit(
        lambda x: sow(x * 2.0, name="double", mode="strict") + 1.0,
        in_shardings=spec,
        out_shardings=spec,
    )
    xs = jax.device_put(X, spec)
    out, reaps = call_and_reap(f)(xs)
    np.testing.assert_allclose(out, X * 2 + 1)
    np.testing.assert_allclose(reaps["double"], X * 2)
    assert out.sharding.spec == P("x", "y")
    assert len(reaps["double"].sharding.device_set) == 8
    np.testing.assert_allclose(plant(f)({"double": jnp.zeros((8, 8))}, xs), np.ones((8, 8)))


@pytest.mark.parametrize("mode", ["strict", "clobber", "collect"])
def test_a_pmap_plant_with_another_count_of_rows_is_refused(mode):
    f = jax.pmap(lambda x: sow(x**2, name="sq", mode=mode).sum())
    xs = jnp.arange(24.0).reshape(8, 3)
    wrap = (lambda v: (v,)) if mode == "collect" else (lambda v: v)
    with pytest.raises(ValueError, match=r"name='sq'.* 3 rows.* 8 shards"):
        plant(f)({"sq": wrap(jnp.ones((3, 3)))}, xs)
    rows = jnp.arange(24.0).reshape(8, 3) * 2.0
    np.testing.assert_allclose(plant(f)({"sq": wrap(rows)}, xs), np.asarray(rows).sum(1))


def test_pmap_reaps_one_row_per_device():
    f = jax.pmap(lambda x: sow(x**2, name="sq", mode="strict").sum())
    xs = jnp.arange(24.0).reshape(8, 3)
    out, reaps = call_and_reap(f)(xs)
    np.testing.assert_allclose(out, (xs**2).sum(1))
    np.testing.assert_allclose(reaps["sq"], xs**2)
    np.testing.assert_allclose(plant(f)({"sq": jnp.ones(3)}, xs), np.full(8, 3.0))


@pytest.mark.parametrize("mode", ["collect", "append", "clobber"])
def test_modes_inside_shard_map(mode):
    def f(x):
        def inner(x):
            sow(x.sum(), name="s", mode=mode)
            return x

        return jax.shard_map(inner, mesh=MESH, in_specs=P("x"), out_specs=P("x"))(x)

    got = reap(f)(X)["s"]
    sums = np.array([X[2 * i : 2 * i + 2].sum() for i in range(4)])
    expected = {
        "collect": (np.repeat(sums, 2),),
        "append": np.repeat(sums, 2),
        "clobber": np.repeat(sums, 2),
    }[mode]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)


# sites, the sweeps and reap read one description of shard_map (harvest/_walk/_rules/sharding.py):
# a body that runs once per shard, each shard's value reaped as one row.


def per_shard_sum(mode):
    def inner(x):
        return sow(jnp.tanh(x) * 3.0, name="h", mode=mode) ** 2

    def f(x):
        return jax.shard_map(inner, mesh=MESH, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)

    return f


def shard_blocks(a):
    """`a` [8, 8] as reap lays out shard_map's rows: shard (i, j) holds a[2i:2i+2, 4j:4j+4]."""
    return np.stack([a[2 * i : 2 * i + 2, 4 * j : 4 * j + 4] for i in range(4) for j in range(2)])


@pytest.mark.parametrize("mode", ["strict", "clobber", "collect", "append"])
def test_a_per_shard_plant_with_another_count_of_rows_is_refused(mode):
    f = per_shard_sum(mode)
    wrap = (lambda v: (v,)) if mode == "collect" else (lambda v: v)
    # 8 shards: with 3 rows, shards 3..7 would all read row 2.
    with pytest.raises(ValueError, match=r"name='h'.* 3 rows.* 8"):
        plant(f)({"h": wrap(jnp.ones((3, 2, 4)))}, X)
    rows = jnp.arange(8.0)[:, None, None] * jnp.ones((8, 2, 4))
    got = shard_blocks(np.asarray(plant(f)({"h": wrap(rows)}, X)))
    np.testing.assert_allclose(got, np.asarray(rows) ** 2)  # shard k squares its own row


@pytest.mark.parametrize("mode", ["strict", "append", "collect"])
def test_sites_fires_once_per_shard_as_reap_stacks(mode):
    f = per_shard_sum(mode)
    (info,) = sites(f)(X)
    assert info.fires == 8 and info.where == "shard_map"
    # One row per shard, whatever the mode (a collect entry is stacked per shard).
    assert jax.tree.leaves(reap(f)(X)["h"])[0].shape == (info.fires, *info.shape)


def test_pmap_sites_fires_once_per_device():
    f = jax.pmap(lambda x: sow(x**2, name="sq", mode="strict").sum())
    xs = jnp.arange(24.0).reshape(8, 3)
    assert [s.fires for s in sites(f)(xs)] == [8]


@pytest.mark.parametrize("mode", ["strict", "append"])
def test_patching_sweep_inside_shard_map_matches_patching_by_hand(mode):
    f = per_shard_sum(mode)
    clean_x, corrupt_x = X, X[::-1] - 1.0
    clean = reap(f)(clean_x)
    result = patching_sweep(f, clean, (corrupt_x,), jnp.sum)
    # By hand: the corrupted run with shard k's value taken from the clean run.
    clean_h, corrupt_h = (
        shard_blocks(np.tanh(clean_x) * 3.0),
        shard_blocks(np.tanh(corrupt_x) * 3.0),
    )
    by_hand = [(clean_h[k] ** 2).sum() - (corrupt_h[k] ** 2).sum() for k in range(8)]
    np.testing.assert_allclose(result.values, by_hand, rtol=1e-4)
    np.testing.assert_allclose(
        result.values.sum(), ((clean_h**2) - (corrupt_h**2)).sum(), rtol=1e-4
    )
    attributed = attribution_patching(f, clean, (corrupt_x,), jnp.sum)
    assert attributed.values.shape == result.values.shape


# Issue 23 item 1: a sow in one branch of a cond, and values varying over some mesh axes.


def one_branch_cond(mode, predicate):
    def inner(x):
        def sows(x):
            return sow(x * 2.0, name="h", mode=mode) + 1.0

        taken = x.sum() > 20.0 if predicate == "data" else jax.lax.axis_index("y") == 0
        return jax.lax.cond(taken, sows, lambda x: x - 1.0, x)

    def f(x):
        return jax.shard_map(inner, mesh=MESH, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)

    return f


@pytest.mark.parametrize("predicate", ["data", "axis_index"])
@pytest.mark.parametrize("mode", ["collect", "append", "clobber"])
def test_one_branch_cond_inside_shard_map_reaps_zeros_where_it_did_not_sow(mode, predicate):
    f = one_branch_cond(mode, predicate)
    out, reaped = call_and_reap(f)(X)
    np.testing.assert_allclose(out, f(X), rtol=1e-6)
    # By hand: shard k sows its block doubled if it took the sowing branch, else zeros.
    blocks = shard_blocks(np.asarray(X))
    took = [
        blocks[k].sum() > 20.0 if predicate == "data" else k % 2 == 0 for k in range(len(blocks))
    ]
    assert 0 < sum(took) < len(took)  # both branches run on some shard
    by_hand = np.stack([b * 2.0 if t else np.zeros_like(b) for b, t in zip(blocks, took)])
    got = reaped["h"][0] if mode == "collect" else reaped["h"]
    np.testing.assert_allclose(np.asarray(got).reshape(by_hand.shape), by_hand, rtol=1e-6)
    np.testing.assert_allclose(plant(f)(reaped, X), f(X), rtol=1e-6)


@pytest.mark.parametrize("mode", ["collect", "append", "clobber"])
def test_one_branch_cond_under_explicit_sharding(mode):
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))

    def f(x):
        sows = lambda x: sow(x * 2.0, name="h", mode=mode) + 1.0  # noqa: E731
        return jax.lax.cond(x.sum() > 0.0, sows, lambda x: x - 1.0, x)

    with jax.set_mesh(mesh):
        for x0, expected in ((1.0, 2.0), (-1.0, 0.0)):  # each branch taken once
            x = jax.device_put(jnp.full(8, x0), NamedSharding(mesh, P("d")))
            got = jax.tree.leaves(reap(f)(x)["h"])[0]
            np.testing.assert_allclose(np.ravel(got), np.full(8, expected))


def _one_branch(mode):
    def step(x):
        sows = lambda x: sow(x * 2.0, name="h", mode=mode) + 1.0  # noqa: E731
        return jax.lax.cond(x.sum() > 0.0, sows, lambda x: x - 1.0, x)

    return step


def _in_scan(mode):
    return lambda x: jax.lax.scan(lambda c, _: (_one_branch(mode)(c), None), x, None, length=3)[0]


def _in_while(mode):
    body = lambda c: (c[0] + 1, _one_branch(mode)(c[1]))  # noqa: E731
    return lambda x: jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]


def _in_jit(mode):
    return jax.jit(_one_branch(mode))


def _jit_in_branch(mode):
    sows = jax.jit(lambda x: sow(x * 2.0, name="h", mode=mode) + 1.0)
    return lambda x: jax.lax.cond(x.sum() > 0.0, sows, lambda x: x - 1.0, x)


# Each program by hand for x = full(8, x0): the values of h it sows, in order.
# One step maps c to 2c + 1 (sowing 2c) where c > 0, else to c - 1.
def _sown_by_hand(x0, steps):
    c, sown = x0, []
    for _ in range(steps):
        if c > 0:
            sown.append(2.0 * c)
        c = 2.0 * c + 1.0 if c > 0 else c - 1.0
    return c, sown


@pytest.mark.parametrize(
    "where,steps",
    [("cond", 1), ("scan", 3), ("while", 3), ("jit", 1), ("jit_in_branch", 1)],
)
@pytest.mark.parametrize("x0", [1.0, -1.0])
def test_one_branch_cond_under_explicit_sharding_in_loops_and_jits(where, steps, x0):
    # A carried name (clobber) rides a scan's or a while's carry: its zeros
    # before the first sow must be typed as the sow's value (sharded along "d").
    build = {
        "cond": _one_branch,
        "scan": _in_scan,
        "while": _in_while,
        "jit": _in_jit,
        "jit_in_branch": _jit_in_branch,
    }[where]
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = build("clobber")
    last, sown = _sown_by_hand(x0, steps)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.full(8, x0), NamedSharding(mesh, P("d")))
        out, reaped = call_and_reap(f)(x)
        np.testing.assert_allclose(out, np.full(8, last))
        np.testing.assert_allclose(reaped["h"], np.full(8, sown[-1] if sown else 0.0))
        planted = plant(f)({"h": jnp.full(8, 5.0, jnp.float32)}, x)
        # By hand: every sow gives 5 (so the step gives 6) where it fires.
        c = x0
        for _ in range(steps):
            c = 6.0 if c > 0 else c - 1.0
        np.testing.assert_allclose(planted, np.full(8, c))
        if where == "scan":  # append: a row per iteration, zeros where the cond did not sow
            c, by_hand = x0, []
            for _ in range(steps):
                by_hand.append(np.full(8, 2.0 * c if c > 0 else 0.0))
                c = 2.0 * c + 1.0 if c > 0 else c - 1.0
            np.testing.assert_allclose(reap(build("append"))(x)["h"], np.stack(by_hand))


def partly_varying(x):
    total = jax.lax.psum(x, "y")  # varies over "x" only
    return sow(total * 2.0, name="t", mode="clobber") + x


PARTLY = jax.shard_map(partly_varying, mesh=MESH, in_specs=P("x", "y"), out_specs=P("x", "y"))


def test_a_plant_varies_over_exactly_the_axes_the_sown_value_does():
    reaped = reap(PARTLY)(X)
    assert reaped["t"].shape == (8, 2, 4)  # a row per shard, equal along "y"
    np.testing.assert_allclose(plant(PARTLY)(reaped, X), PARTLY(X), rtol=1e-6)
    # A stacked per-shard plant: by hand, shard (i, j) adds row i * 2 (its row at y = 0).
    rows = jnp.arange(8.0)[:, None, None] * jnp.ones((8, 2, 4))
    by_hand = shard_blocks(np.asarray(X)) + np.asarray(rows)[[2 * (k // 2) for k in range(8)]]
    got = shard_blocks(np.asarray(plant(PARTLY)({"t": rows}, X)))
    np.testing.assert_allclose(got, by_hand, rtol=1e-6)
    one = plant(PARTLY)({"t": jnp.ones((2, 4))}, X)
    np.testing.assert_allclose(one, X + 1.0, rtol=1e-6)


def test_without_vma_checks_a_per_shard_plant_reads_each_shards_own_row():
    f = jax.shard_map(
        partly_varying, mesh=MESH, in_specs=P("x", "y"), out_specs=P("x", "y"), check_vma=False
    )
    rows = jnp.arange(8.0)[:, None, None] * jnp.ones((8, 2, 4))
    got = shard_blocks(np.asarray(plant(f)({"t": rows}, X)))
    np.testing.assert_allclose(got, shard_blocks(np.asarray(X)) + np.asarray(rows), rtol=1e-6)
