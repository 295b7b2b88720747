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
