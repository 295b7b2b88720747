"""`jax.debug.callback` / `jax.debug.print` after a planted site see the planted
value, as they do in the program with the plant written in by hand: at top level
and inside jit, cond, scan, while_loop and vmap, planted eagerly, under jit and
under vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import harvest, plant, sow

SEEN: list[np.ndarray] = []


def _see(v):
    SEEN.append(np.asarray(v))


def _callback(h):
    jax.debug.callback(_see, h)


def _top(x, sown, show=_callback):
    h = sown(x * 2.0)
    show(h)
    return h + 1.0


def _ordered(x, sown, show=_callback):
    h = sown(x * 2.0)
    if show is _callback:
        jax.debug.callback(_see, h, ordered=True)
    else:
        jax.debug.print("h={h}", h=h, ordered=True)
    return h + 1.0


def _in_jit(x, sown, show=_callback):
    @jax.jit
    def inner(x):
        h = sown(x * 2.0)
        show(h)
        return h

    return inner(x) + 1.0


def _in_cond(x, sown, show=_callback):
    h = sown(x * 2.0)
    jax.lax.cond(x > 0, lambda: show(h), lambda: None)
    return h + 1.0


def _in_scan(x, sown, show=_callback):
    def body(c, _):
        h = sown(c * 2.0)
        show(h)
        return h, None

    return jax.lax.scan(body, x, None, length=2)[0]


def _in_vmap(x, sown, show=_callback):
    def row(r):
        h = sown(r * 2.0)
        show(h)
        return h

    return jax.vmap(row)(jnp.stack([x, x + 1.0])).sum()


def _in_while(x, sown, show=_callback):
    def body(c):
        i, v = c
        h = sown(v * 2.0)
        show(h)
        return i + 1, h

    return jax.lax.while_loop(lambda c: c[0] < 2, body, (0, x))[1]


PROGRAMS = {
    "top": _top,
    "ordered": _ordered,
    "jit": _in_jit,
    "cond": _in_cond,
    "scan": _in_scan,
    "vmap": _in_vmap,
    "while": _in_while,
}


def _in_any_order(seen):
    """The values seen, sorted: unordered callbacks under vmap run in any order."""
    return np.sort(np.concatenate([np.ravel(v) for v in seen]))


def _run(fn, *args):
    SEEN.clear()
    out = jax.block_until_ready(fn(*args))
    jax.effects_barrier()
    return out, list(SEEN)


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.parametrize("how", ["plant", "jit_plant", "vmap_plant", "harvest", "callable"])
def test_debug_callback_after_a_planted_site_sees_the_planted_value(name, how):
    program = PROGRAMS[name]
    mode = "clobber"
    f = lambda x: program(x, lambda v: sow(v, name="h", mode=mode))  # noqa: E731
    x = jnp.float32(1.5)
    if how == "callable":
        planted_by_hand = lambda x: program(x, lambda v: v * 3.0 + 1.0)  # noqa: E731
        run = lambda x: plant(f)({"h": lambda v: v * 3.0 + 1.0}, x)  # noqa: E731
    elif how == "vmap_plant":  # a plant per example, of the example's own value
        x = jnp.array([1.5, -0.5, 2.0])
        planted_by_hand = jax.vmap(lambda x: program(x, lambda v: v - v + x + 7.0))
        run = jax.vmap(lambda x: plant(f)({"h": x + 7.0}, x))
    else:
        # 7 written in where h was, batched as h is (a plant fills every example)
        planted_by_hand = lambda x: program(x, lambda v: v - v + 7.0)  # noqa: E731
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
    np.testing.assert_allclose(_in_any_order(got_seen), _in_any_order(want_seen))


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
    # Unordered callbacks: JAX promises no order among them (a TPU may run them in any).
    seen = np.sort(np.concatenate([np.ravel(s) for s in seen]))
    np.testing.assert_allclose(seen, np.arange(3.0) + 10.0)
    g, seen = _run(jax.grad(lambda x: plant(f)({"h": x * 5.0}, x)), jnp.float32(2.0))
    np.testing.assert_allclose(g, 20.0)  # d/dx (5x * x) by hand
    np.testing.assert_allclose(np.ravel(seen[0]), 10.0)


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.parametrize("how", ["plant", "jit_plant", "vmap_plant"])
def test_debug_print_after_a_planted_site_prints_what_the_hand_planted_program_prints(
    name, how, capfd
):
    def show(h):
        jax.debug.print("h={h}", h=h)

    program = PROGRAMS[name]
    f = lambda x: program(x, lambda v: sow(v, name="h", mode="clobber"), show)  # noqa: E731
    by_hand = lambda x: program(x, lambda v: v - v + x + 7.0, show)  # noqa: E731
    x = jnp.float32(1.5)
    run = {
        "plant": lambda x: plant(f)({"h": x + 7.0}, x),
        "jit_plant": jax.jit(lambda x: plant(f)({"h": x + 7.0}, x)),
        "vmap_plant": jax.vmap(lambda x: plant(f)({"h": x + 7.0}, x)),
    }[how]
    if how == "vmap_plant":
        x, by_hand = jnp.array([1.5, -0.5, 2.0]), jax.vmap(by_hand)
    printed = []
    for fn in (by_hand, run):
        capfd.readouterr()
        out = jax.block_until_ready(fn(x))
        jax.effects_barrier()
        printed.append((np.asarray(out), sorted(capfd.readouterr().out.splitlines())))
    (want_out, want), (got_out, got) = printed
    np.testing.assert_allclose(got_out, want_out)
    assert want and got == want
    assert any("8.5" in line for line in want)  # the planted value: 1.5 + 7
