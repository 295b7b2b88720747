"""`jax.debug.callback` / `jax.debug.print` after a planted site see the planted
value, as they do in the program with the plant written in by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import harvest, plant, sow

SEEN: list[np.ndarray] = []


def _see(v):
    SEEN.append(np.asarray(v))


def _top(x, sown):
    h = sown(x * 2.0)
    jax.debug.callback(_see, h)
    return h + 1.0


def _ordered(x, sown):
    h = sown(x * 2.0)
    jax.debug.callback(_see, h, ordered=True)
    return h + 1.0


def _in_jit(x, sown):
    @jax.jit
    def inner(x):
        h = sown(x * 2.0)
        jax.debug.callback(_see, h)
        return h

    return inner(x) + 1.0


def _in_cond(x, sown):
    h = sown(x * 2.0)
    jax.lax.cond(x > 0, lambda: jax.debug.callback(_see, h), lambda: None)
    return h + 1.0


def _in_scan(x, sown):
    def body(c, _):
        h = sown(c * 2.0)
        jax.debug.callback(_see, h)
        return h, None

    return jax.lax.scan(body, x, None, length=2)[0]


PROGRAMS = {"top": _top, "ordered": _ordered, "jit": _in_jit, "cond": _in_cond, "scan": _in_scan}


def _run(fn, *args):
    SEEN.clear()
    out = jax.block_until_ready(fn(*args))
    jax.effects_barrier()
    return out, list(SEEN)


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.parametrize("how", ["plant", "jit_plant", "harvest", "callable"])
def test_debug_callback_after_a_planted_site_sees_the_planted_value(name, how):
    program = PROGRAMS[name]
    mode = "clobber"
    f = lambda x: program(x, lambda v: sow(v, name="h", mode=mode))  # noqa: E731
    x = jnp.float32(1.5)
    if how == "callable":
        planted_by_hand = lambda x: program(x, lambda v: v * 3.0 + 1.0)  # noqa: E731
        run = lambda x: plant(f)({"h": lambda v: v * 3.0 + 1.0}, x)  # noqa: E731
    else:
        planted_by_hand = lambda x: program(x, lambda v: jnp.float32(7.0))  # noqa: E731
        p = {"h": jnp.float32(7.0)}
        run = {
            "plant": lambda x: plant(f)(p, x),
            "jit_plant": lambda x: jax.jit(plant(f))(p, x),
            "harvest": lambda x: harvest(f)(p, x)[0],
        }[how]
    want_out, want_seen = _run(planted_by_hand, x)
    got_out, got_seen = _run(run, x)
    np.testing.assert_allclose(got_out, want_out)
    assert len(got_seen) == len(want_seen) > 0
    np.testing.assert_allclose(np.stack(got_seen), np.stack(want_seen))


def test_debug_print_after_a_planted_site_prints_the_planted_value(capfd):
    def f(x):
        h = sow(x * 2.0, name="h", mode="strict")
        jax.debug.print("h={h}", h=h)
        return h

    jax.block_until_ready(plant(f)({"h": jnp.float32(10.0)}, 1.0))
    jax.effects_barrier()
    assert "h=10.0" in capfd.readouterr().out


def test_debug_callback_under_vmap_and_grad_sees_the_planted_value():
    def f(x):
        h = sow(x * 2.0, name="h", mode="strict")
        jax.debug.callback(_see, h)
        return h * x

    _, seen = _run(jax.vmap(lambda x: plant(f)({"h": x + 10.0}, x)), jnp.arange(3.0))
    np.testing.assert_allclose(np.concatenate([np.ravel(s) for s in seen]), np.arange(3.0) + 10.0)
    g, seen = _run(jax.grad(lambda x: plant(f)({"h": x * 5.0}, x)), jnp.float32(2.0))
    np.testing.assert_allclose(g, 20.0)  # d/dx (5x * x) by hand
    np.testing.assert_allclose(np.ravel(seen[0]), 10.0)
