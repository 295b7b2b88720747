"""A planted callable under vmap sees one example, as the function that sows does.

Every case is compared with the hand-threaded program: the function written
with the callable applied inline where it sows, vmapped by JAX. The callables
are chosen so that seeing the whole batch gives another answer (`old[0]`,
`old.sum()`, `old.shape`, `jnp.roll`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import close
from flax import nnx
from jax import lax

from harvest import (
    ablate_head,
    ablate_mean,
    ablate_zero,
    add_vector,
    attribution_patching,
    harvest,
    instrument,
    patch_head,
    patch_positions,
    patching_sweep,
    plant,
    reap,
    sow,
    stream,
)

B, T, D = 3, 4, 2
XS = jax.random.normal(jax.random.key(0), (B, T, D))
W = jnp.arange(1.0, T * D + 1.0).reshape(T, D) / (T * D)

# Each differs over one example [T, D] from over the batch [B, T, D].
CALLABLES = {
    "first_row": lambda old: old - old[0],
    "sum": lambda old: old / old.sum(),
    "shape": lambda old: old * old.shape[0],
    "roll": lambda old: jnp.roll(old, 1, axis=0),
}


def one(x, at):
    """One example [T, D]; `at(name, value)` is the site: a sow, or the callable inline."""
    h = at("h", jnp.tanh(x) * 2.0)
    g = at("g", h * W + h[0])
    return (g**2).sum() + g[-1, 0]


def sown(name, value):
    return sow(value, name=name, mode="strict")


def inline(plants):
    return lambda name, value: plants[name](value) if name in plants else value


f = lambda x: one(x, sown)  # noqa: E731


@pytest.mark.parametrize("name", CALLABLES)
def test_vmap_of_plant_and_vmap_inside_f(name):
    fn = CALLABLES[name]
    want = jax.vmap(lambda x: one(x, inline({"h": fn})))(XS)
    close(jax.vmap(lambda x: plant(f)({"h": fn}, x))(XS), want)
    close(plant(jax.vmap(f))({"h": fn}, XS), want)
    # The batch inside f, something else done to the output after.
    close(plant(lambda xs: jax.vmap(f)(xs) * 2.0)({"h": fn}, XS), want * 2.0)


def test_nested_vmaps_two_batch_axes():
    fn = CALLABLES["first_row"]
    xss = jnp.stack([XS, XS * 0.5 - 1.0])  # [2, B, T, D]
    plants = {"h": fn, "g": lambda old: jnp.cumsum(old, axis=0)}
    want = jax.vmap(jax.vmap(lambda x: one(x, inline(plants))))(xss)
    close(plant(jax.vmap(jax.vmap(f)))(plants, xss), want)
    close(jax.vmap(plant(jax.vmap(f)), in_axes=(None, 0))(plants, xss), want)


def test_a_site_batched_by_the_inner_vmap_only():
    # h depends on y alone: the outer vmap leaves it unbatched, the inner one batches it.
    def g(x, y, at):
        h = at("h", jnp.tanh(y))
        return (h * x).sum()

    xs, ys = XS[:, 0], XS[0]  # [B, D], [T, D]
    fn = CALLABLES["sum"]
    run = lambda at: jax.vmap(lambda x: jax.vmap(lambda y: g(x, y, at))(ys))(xs)  # noqa: E731
    close(plant(lambda: run(sown))({"h": fn}), run(inline({"h": fn})))


def test_leaves_batched_by_different_vmaps_are_paired_per_example():
    # Leaf a follows the outer vmap, leaf b the inner one (both have one batch
    # axis, of different vmaps): the callable sees one (outer, inner) example.
    def g(x, y, at):
        v = at("v", {"a": x * 2.0, "b": jnp.tanh(y)})
        return (v["a"] * v["b"]).sum()

    def fn(old):
        return {"a": old["a"] + old["b"].sum(), "b": old["b"] * old["a"][0]}

    xs, ys = XS[:, 0], XS[1, :3]  # [B, D], [3, D]
    run = lambda at: jax.vmap(lambda x: jax.vmap(lambda y: g(x, y, at))(ys))(xs)  # noqa: E731
    close(plant(lambda: run(sown))({"v": fn}), run(inline({"v": fn})))


def test_under_jit_of_vmap_and_grad_of_vmap():
    fn = CALLABLES["roll"]
    ref = lambda xs: jax.vmap(lambda x: one(x, inline({"h": fn})))(xs)  # noqa: E731
    got = lambda xs: plant(jax.vmap(f))({"h": fn}, xs)  # noqa: E731
    close(jax.jit(got)(XS), ref(XS))
    close(jax.jit(jax.vmap(lambda x: plant(f)({"h": fn}, x)))(XS), ref(XS))
    close(jax.grad(lambda xs: got(xs).sum())(XS), jax.grad(lambda xs: ref(xs).sum())(XS))
    close(jax.jit(jax.grad(lambda xs: got(xs).sum()))(XS), jax.grad(lambda xs: ref(xs).sum())(XS))


def layers(x, at, n=3):
    """A scan over `n` layers of one example; `at(value, i)` is the site in layer i."""

    def step(c, i):
        c = at(jnp.tanh(c) + i, i)
        return c, None

    return lax.scan(step, x, jnp.arange(n, dtype=jnp.float32))[0]


def test_scan_inside_f_under_vmap_and_an_index_callable():
    scanned = lambda x: layers(x, lambda v, i: sow(v, name="h", mode="append"))  # noqa: E731
    fn = CALLABLES["first_row"]
    close(
        plant(jax.vmap(scanned))({"h": fn}, XS),
        jax.vmap(lambda x: layers(x, lambda v, i: fn(v)))(XS),
    )
    # (old, index): the layer's index, and the example's own first row.
    by_index = lambda old, i: old * i - old[0]  # noqa: E731
    close(
        plant(jax.vmap(scanned))({"h": by_index}, XS),
        jax.vmap(lambda x: layers(x, lambda v, i: by_index(v, i)))(XS),
    )
    # The vmap inside the scan's body instead.
    per_layer = lambda xs: layers(  # noqa: E731
        xs, lambda v, i: jax.vmap(lambda e: sow(e, name="h", mode="append"))(v)
    )
    close(
        plant(per_layer)({"h": by_index}, XS),
        layers(XS, lambda v, i: jax.vmap(lambda e: by_index(e, i))(v)),
    )


def test_an_index_callable_in_a_while_loop_whose_trips_differ_per_example():
    # Each example loops until its own sum passes 4: its occurrences are counted per example.
    def loop(x, at):
        def body(carry):
            v, n = carry
            return at(v + 1.0, n), n + 1

        return lax.while_loop(lambda c: c[0].sum() < 4.0, body, (x, 0))[0]

    fn = lambda old, i: old * (i + 1.0) - old[0]  # noqa: E731
    xs = jnp.array([[0.0, 0.0], [1.0, 1.5], [3.0, 2.0]])
    got = plant(jax.vmap(lambda x: loop(x, lambda v, n: sow(v, name="v", mode="clobber"))))
    close(got({"v": fn}, xs), jax.vmap(lambda x: loop(x, fn))(xs))


def test_harvest_plants_per_example_and_reaps_the_rest():
    fn = CALLABLES["sum"]
    out, reaped = harvest(jax.vmap(f))({"h": fn}, XS)

    def ref(x):
        h = fn(jnp.tanh(x) * 2.0)
        g = h * W + h[0]
        return (g**2).sum() + g[-1, 0], g

    want, g = jax.vmap(ref)(XS)
    close((out, reaped), (want, {"g": g}))


def test_a_callable_returning_the_whole_batch_is_an_error_naming_one_example():
    with pytest.raises(
        ValueError, match=r"for one example of the vmap around the sow.*float32\[4, 2\]"
    ):
        plant(jax.vmap(f))({"h": lambda old: XS}, XS)


# ---------------------------------------------------------------------------
# Instrumented models, the batch inside them.


class Wrapped(nnx.Module):
    """The last layer applied per position through `nnx.vmap`."""

    def __init__(self, rngs):
        self.first = nnx.Linear(D, D, rngs=rngs)
        self.last = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):  # [T, D]
        h = jnp.tanh(self.first(x))
        return nnx.vmap(lambda m, e: m(e), in_axes=(None, 0))(self.last, h)


def test_an_instrumented_nnx_module_with_nnx_vmap_inside():
    model = Wrapped(nnx.Rngs(3))
    x = XS[0]
    fn = lambda old: old - old.sum()  # noqa: E731  one position's [D]
    w, b = model.last.kernel[...], model.last.bias[...]
    h = jnp.tanh(model.first(x))
    want = jax.vmap(lambda e: fn(e @ w + b))(h)
    close(plant(instrument(model), tag="modules")({"last": fn}, x), want)


class Tokens(eqx.Module):
    """An Equinox model of one example [T, D], its layer applied per token, as Equinox does."""

    inner: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.inner = eqx.nn.Linear(D, D, key=k1)
        self.out = eqx.nn.Linear(D, 1, key=k2)

    def __call__(self, x):
        return jax.vmap(self.out)(jnp.tanh(jax.vmap(self.inner)(x))).sum()


def test_an_instrumented_equinox_model_under_vmap():
    model = Tokens(jax.random.key(4))
    probed = instrument(model)
    fn = lambda old: jnp.roll(old, 1) * old.shape[0]  # noqa: E731  one token's [D]

    def hand(x):
        h = jax.vmap(lambda e: fn(model.inner.weight @ e + model.inner.bias))(x)
        return jax.vmap(model.out)(jnp.tanh(h)).sum()

    want = jax.vmap(hand)(XS)
    close(plant(lambda xs: jax.vmap(probed)(xs), tag="modules")({"inner": fn}, XS), want)
    close(jax.vmap(lambda x: plant(probed, tag="modules")({"inner": fn}, x))(XS), want)


# ---------------------------------------------------------------------------
# harvest's interventions under vmap.


def _inline(value):
    """The hand-threaded program with `value(old)` at h, vmapped over XS."""
    return jax.vmap(lambda x: one(x, inline({"h": value})))(XS)


def test_patch_positions_under_vmap():
    clean = reap(jax.vmap(f))(XS * -1.0)["h"]  # [B, T, D], one per example
    pos = jnp.array([1, 3])
    planted = plant(jax.vmap(f))
    # One clean example for every example, its axis counted in one example.
    one_clean = clean[0]
    close(
        planted({"h": patch_positions(one_clean, pos, axis=0)}, XS),
        _inline(lambda old: old.at[pos].set(one_clean[pos])),
    )
    # One clean value per example, its axes counted as reap returns it (batch first).
    got = planted({"h": patch_positions(clean, pos, axis=1)}, XS)
    want = jax.vmap(lambda x, c: one(x, inline({"h": lambda old: old.at[pos].set(c[pos])})))(
        XS, clean
    )
    close(got, want)
    # Positions along the batch axis itself: those examples take their clean value whole.
    got = planted({"h": patch_positions(clean, [0, 2], axis=0)}, XS)
    keep = jnp.array([True, False, True])
    want = jax.vmap(lambda x, c, k: one(x, inline({"h": lambda old: jnp.where(k, c, old)})))(
        XS, clean, keep
    )
    close(got, want)
    # Under vmap of plant, each example's own clean value.
    close(
        jax.vmap(lambda x, c: plant(f)({"h": patch_positions(c, pos, axis=0)}, x))(XS, clean),
        jax.vmap(lambda x, c: one(x, inline({"h": lambda old: old.at[pos].set(c[pos])})))(
            XS, clean
        ),
    )


def test_steering_and_ablations_under_vmap():
    planted = plant(jax.vmap(f))
    v = jnp.array([1.0, -2.0])
    close(planted({"h": add_vector(v, 0.5)}, XS), _inline(lambda old: old + 0.5 * v))
    per_example = jax.random.normal(jax.random.key(1), (B, T, D))  # one vector per example
    got = planted({"h": add_vector(per_example)}, XS)
    want = jax.vmap(lambda x, p: one(x, inline({"h": lambda old: old + p})))(XS, per_example)
    close(got, want)
    mean = reap(jax.vmap(f))(XS)["h"].mean(0)  # [T, D]
    close(planted({"h": ablate_mean(mean)}, XS), _inline(lambda old: mean))
    close(planted({"h": ablate_zero()}, XS), _inline(jnp.zeros_like))


def heads(x, at):
    """One example [T, D] with a per-head site z [T, H, E]; head 1 counts double."""
    z = at("z", jnp.stack([jnp.tanh(x), x**2, x * 0.5], axis=1))  # [T, 3, D]
    return (z * jnp.array([1.0, 2.0, 3.0])[:, None]).sum()


def test_head_interventions_under_vmap():
    planted = plant(jax.vmap(lambda x: heads(x, sown)))
    per_head = lambda fn: jax.vmap(lambda x: heads(x, inline({"z": fn})))(XS)  # noqa: E731
    # The head axis of one example (1), or counted from the end.
    for axis in (1, -2):
        close(planted({"z": ablate_head(1, axis=axis)}, XS), per_head(lambda z: z.at[:, 1].set(0)))
    clean = reap(jax.vmap(lambda x: heads(x, sown)))(XS + 1.0)["z"]  # [B, T, 3, D]
    got = planted({"z": patch_head(clean, 2, axis=2)}, XS)  # clean's own axes: batch first
    want = jax.vmap(lambda x, c: heads(x, inline({"z": lambda z: z.at[:, 2].set(c[:, 2])})))(
        XS, clean
    )
    close(got, want)


def test_patching_sweep_and_attribution_of_a_model_vmapped_inside():
    model = lambda xs: jax.vmap(f)(xs).sum()  # noqa: E731
    clean_x = XS * -1.0
    clean = reap(model)(clean_x)
    metric = lambda out: out  # noqa: E731
    base = model(XS)
    for axis in (0, 1):  # every example, then every position of every example
        r = patching_sweep(model, clean, (XS,), metric, names="h", axis=axis)
        corrupt = reap(model)(XS)["h"]
        want = []
        for j in range(corrupt.shape[axis]):
            at = (slice(None),) * axis + (j,)
            value = corrupt.at[at].set(clean["h"][at])  # the array planted whole
            want.append(plant(model)({"h": value}, XS) - base)
        np.testing.assert_allclose(r.values[0], np.array(want), rtol=1e-4, atol=1e-5)
    # Attribution: the first-order estimate, d metric / d h by hand.
    r = attribution_patching(model, clean, (XS,), metric, names="h", axis=1)
    corrupt = reap(model)(XS)["h"]
    grad = jax.grad(
        lambda h: jax.vmap(lambda x, e: one(x, inline({"h": lambda _: e})))(XS, h).sum()
    )(corrupt)
    want = ((clean["h"] - corrupt) * grad).sum(axis=(0, 2))
    np.testing.assert_allclose(r.values[0], want, rtol=1e-4, atol=1e-5)


def test_stream_sees_the_whole_batch_of_a_vmap_inside_f():
    seen = []
    out = stream(jax.vmap(f), lambda name, v: seen.append((name, np.asarray(v))))(XS)
    jax.effects_barrier()
    close(out, jax.vmap(f)(XS))
    reaped = reap(jax.vmap(f))(XS)
    assert [n for n, _ in seen] == ["h", "g"]
    for name, value in seen:
        np.testing.assert_allclose(value, reaped[name], rtol=1e-6)


def test_a_sweep_over_layers_of_a_model_vmapped_inside():
    # A scan over layers inside the vmap: each occurrence is a row h[j]; patch
    # every example of it in turn (PatchOccurrence), or estimate it (AddRow).
    step = lambda v, i: sow(v, name="h", mode="append")  # noqa: E731
    model = lambda xs: (jax.vmap(lambda x: layers(x, step))(xs) ** 2).sum()  # noqa: E731
    clean, corrupt = reap(model)(XS * -1.0)["h"], reap(model)(XS)["h"]  # [3, B, T, D]
    per_example = jnp.moveaxis(clean, 1, 0)  # [B, 3, T, D]

    def by_hand(j, b):  # layer j of example b takes its clean value
        def one_example(x, c, is_b):
            return layers(x, lambda v, i: jnp.where((i == j) & is_b, c[j], v))

        return (jax.vmap(one_example)(XS, per_example, jnp.arange(B) == b) ** 2).sum()

    base = model(XS)
    r = patching_sweep(model, {"h": clean}, (XS,), lambda o: o, axis=0)
    assert r.names == ("h[0]", "h[1]", "h[2]")
    want = [[by_hand(j, b) - base for b in range(B)] for j in range(3)]
    np.testing.assert_allclose(r.values, np.array(want), rtol=1e-4, atol=1e-5)

    def offset(deltas):  # d metric / d h, every layer's value moved by its delta
        one_example = lambda x, d: layers(x, lambda v, i: v + d[i.astype(int)])  # noqa: E731
        return (jax.vmap(one_example)(XS, deltas) ** 2).sum()

    grad = jnp.moveaxis(jax.grad(offset)(jnp.zeros_like(per_example)), 0, 1)  # [3, B, T, D]
    r = attribution_patching(model, {"h": clean}, (XS,), lambda o: o, axis=0)
    np.testing.assert_allclose(
        r.values, ((clean - corrupt) * grad).sum(axis=(2, 3)), rtol=1e-4, atol=1e-5
    )
