"""How harvest tells `lax.map(f, xs, batch_size=b)`'s vmaps from a user's vmap.

Each case is checked against values computed by hand: a batched lax.map sows
once per element (as `lax.map(f, xs)` does), while `jax.vmap(f)` and a scan
the user writes over a vmap of `f` sow once per batch, its value `[b, ...]`.
Were detection to miss lax.map, or to take a user's vmap for it, one of
these would fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from harvest import reap, sites, sow


def _g(x):
    return jnp.sin(sow(x * 2.0, name="h", mode="clobber")) + x


def _close(a, b):
    jax.tree_util.tree_map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6), a, b)


# 1: the remainder alone (staged exactly as jax.vmap(f)(xs)); 3: both parts;
# 4: full batches only.
@pytest.mark.parametrize("n", [1, 3, 4])
def test_a_batched_lax_map_sows_per_element_and_a_users_vmap_per_batch(n):
    xs = jnp.arange(float(n)) / 3.0
    # clobber keeps the last occurrence: the last element's value under lax.map ...
    _close(reap(lambda xs: lax.map(_g, xs, batch_size=2))(xs), {"h": xs[-1] * 2.0})
    # ... the whole batch's under a vmap (the same jaxpr as the remainder alone) ...
    _close(reap(jax.vmap(_g))(xs), {"h": xs * 2.0})
    # ... and the last batch's under a scan the user writes over a vmap of f.
    if n % 2 == 0:

        def scan_of_vmap(xs):
            body = lambda c, x: (c, jax.vmap(_g)(x))  # noqa: E731
            return lax.scan(body, 0.0, xs.reshape(-1, 2))[1]

        _close(reap(scan_of_vmap)(xs), {"h": xs[-2:] * 2.0})


@pytest.mark.parametrize("n", [1, 3, 4, 5])
def test_collect_entries_merge_per_map_whichever_parts_it_runs(n):
    # A map with the remainder alone right after one with full batches only (and
    # the reverse) stays apart: which parts each map runs is read per map.
    def f(xs, batch_size=2):
        g = lambda x: sow(x + 1.0, name="k") * 2.0  # noqa: E731
        first = lax.map(g, xs, batch_size=batch_size)
        return first, lax.map(g, xs[: max(n - 2, 1)], batch_size=batch_size)

    xs = jnp.arange(float(n))
    want = {"k": (xs + 1.0, xs[: max(n - 2, 1)] + 1.0)}  # by hand: one entry per map
    _close(reap(f)(xs), want)
    # sites lists each element's sow apart; together they fire as without batch_size.
    assert sum(s.fires for s in sites(f)(xs)) == sum(s.fires for s in sites(f)(xs, None))


def test_a_users_scan_over_a_vmap_with_no_carry_sows_per_batch():
    # Staged as lax.map's full batches are (a scan with no carry over a reshape, its
    # body f vmapped): only the code that staged it differs, so it sows per batch.
    g = lambda x: jnp.sin(sow(x * 2.0, name="h", mode="append")) + x  # noqa: E731
    xs = jnp.arange(6.0) / 3.0
    by_hand = lambda xs: lax.scan(lambda _, x: ((), jax.vmap(g)(x)), (), xs.reshape(-1, 2))[1]  # noqa: E731
    _close(reap(by_hand)(xs), {"h": (xs * 2.0).reshape(3, 2)})
    _close(reap(lambda xs: lax.map(g, xs, batch_size=2))(xs), {"h": xs * 2.0})


def test_lax_map_without_batch_size_of_a_vmapped_function_sows_per_vmap():
    # lax.map's own scan body calls f, here a jax.vmap: that vmap is the user's,
    # not a batched map's, so each step sows its whole row.
    g = lambda x: jnp.sin(sow(x * 2.0, name="h", mode="clobber")) + x  # noqa: E731
    xs = jnp.arange(12.0).reshape(3, 4) / 5.0
    _close(reap(lambda xs: lax.map(jax.vmap(g), xs))(xs), {"h": xs[-1] * 2.0})


@pytest.mark.parametrize("mode", ["append", "collect"])
def test_a_vmap_inside_the_maps_function_keeps_its_axis(mode):
    # The sow (in a jit) is batched by the user's vmap, then by the map's: only
    # the map's elements are sown apart, each keeping the user's axis.
    inner = jax.jit(lambda z: sow(z * 2.0, name="h", mode=mode) + 1.0)
    f = lambda xs, b: lax.map(lambda x: jax.vmap(inner)(x), xs, batch_size=b)  # noqa: E731
    xs = jnp.arange(20.0).reshape(5, 4)
    rows = xs * 2.0  # by hand: element i sows row i
    _close(reap(f)(xs, 2), {"h": rows if mode == "append" else (rows,)})
    _close(reap(f)(xs, None), reap(f)(xs, 2))


def test_a_jitted_body_traced_elsewhere_first_is_still_per_element():
    # JAX reuses the body traced outside any map (and under a vmap of the map's
    # batch size), with the traceback of that first trace.
    helper = jax.jit(lambda x: sow(x * 3.0, name="k", mode="append") - 1.0)
    xs = jnp.arange(5.0)
    reap(helper)(xs[0])
    reap(jax.vmap(helper))(xs[:2])
    f = lambda xs: lax.map(helper, xs, batch_size=2)  # noqa: E731
    _close(reap(f)(xs), {"k": xs * 3.0})
    # A vmap of it still sows per batch, as the same function unjitted does.
    plain = lambda x: sow(x * 3.0, name="k", mode="append") - 1.0  # noqa: E731
    _close(reap(jax.vmap(helper))(xs[:2]), reap(jax.vmap(plain))(xs[:2]))


@pytest.mark.parametrize("sizes", [(4, 1), (1, 5), (4, 5), (5, 5)])
def test_maps_from_one_line_keep_their_collect_entries_apart(sizes):
    # Maps called from one line (a Python loop) are told apart by which parts they
    # run: full batches only, the remainder alone, or both.
    def f(xs, b):
        parts = [xs[: sizes[0]], xs[: sizes[1]]]
        return [lax.map(lambda x: sow(x + 1.0, name="c") * 2.0, p, batch_size=b) for p in parts]

    xs = jnp.arange(5.0) / 3.0
    by_hand = {"c": (xs[: sizes[0]] + 1.0, xs[: sizes[1]] + 1.0)}
    _close(reap(f)(xs, 2), by_hand)
    _close(reap(f)(xs, None), by_hand)


def test_a_vmap_in_a_branch_the_map_runs_for_every_element():
    # The map's vmap batches the cond's predicate, so JAX runs the branch (with a
    # vmap of its own) inline: harvest matches each vmap by the copies it records.
    def f(xs, b):
        branch = lambda y: jax.vmap(lambda z: sow(z * 2.0, name="v", mode="append"))(y)  # noqa: E731
        return lax.map(lambda x: lax.cond(x.sum() > 1.0, branch, lambda y: y, x), xs, batch_size=b)

    xs = jnp.arange(20.0).reshape(5, 4)  # every row's sum > 1: the branch runs for each
    _close(reap(f)(xs, 2), {"v": xs * 2.0})
    _close(reap(f)(xs, None), {"v": xs * 2.0})


def test_no_harvest_code_reads_interpreter_frames():
    # Batched lax.map is found from the tracebacks JAX records on equations.
    import pathlib

    import harvest

    reads = ("_getframe", "f_locals", "currentframe", "inspect.stack", "inspect.trace", ".f_back")
    root = pathlib.Path(harvest.__file__).parent
    found = [
        (str(path.relative_to(root)), word)
        for path in root.rglob("*.py")
        for word in reads
        if word in path.read_text()
    ]
    assert found == []


def test_a_lax_map_harvest_does_not_know_is_refused_not_taken_per_batch(monkeypatch):
    # Should a JAX release change how lax.map calls vmap, harvest says so rather
    # than reap batch-shaped values: it reads the layout from lax.map's code.
    from harvest import _jax, plant
    from harvest._walk._rules import batched_lax_map

    assert _jax.lax_map_layout() is not None  # this JAX's is known
    monkeypatch.setattr(_jax, "lax_map_layout", lambda: None)
    monkeypatch.setattr(batched_lax_map, "SUPPORTED", False)
    g = lambda x: jnp.sin(sow(x * 2.0, name="h", mode="append")) + x  # noqa: E731
    f = lambda xs: lax.map(g, xs, batch_size=2)  # noqa: E731
    xs = jnp.arange(5.0)
    with pytest.raises(ValueError, match=r"name='h'.*runs inside lax.map\(f, xs, batch_size=b\)"):
        reap(f)(xs)
    _close(plant(f)({"h": jnp.float32(7.0)}, xs), jnp.sin(7.0) + xs)  # one value: the same for each
    _close(reap(jax.vmap(g))(xs), {"h": (xs * 2.0)[None]})  # a vmap of yours: one row, not refused
