"""instrument: sites on unmodified NNX, Equinox and Linen models and plain functions.

Every reaped or planted value is checked against the model's forward pass
written out by hand from its parameters (`hand_*` below), with the patched
value substituted by hand.
"""

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import (
    attribution_patching,
    call_and_reap,
    instrument,
    patching_sweep,
    plant,
    reap,
    sites,
    sow,
)

nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

D, T = 8, 5
TOL = dict(rtol=2e-5, atol=2e-5)


class Recorder:
    """The hand-written forward's sites: records each value, or substitutes a patch."""

    def __init__(self, patch=None):
        self.patch = patch or {}
        self.values = {}

    def __call__(self, name, value):
        value = self.patch.get(name, value)
        self.values[name] = value
        return value


# ---------------------------------------------------------------------------
# A small NNX transformer: a list of blocks, LayerNorm, attention.


class Attention(nnx.Module):
    def __init__(self, d, rngs):
        self.q_proj = nnx.Linear(d, d, rngs=rngs)
        self.k_proj = nnx.Linear(d, d, rngs=rngs)
        self.v_proj = nnx.Linear(d, d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        weights = jax.nn.softmax(q @ k.T / np.sqrt(q.shape[-1]), axis=-1)
        return self.out(weights @ v)


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.attn = Attention(d, rngs)
        self.mlp = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln(x))
        return x + jax.nn.gelu(self.mlp(x))


class Transformer(nnx.Module):
    def __init__(self, d, layers, rngs):
        self.blocks = nnx.List([Block(d, rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, 3, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lin(layer, x):
    return x @ layer.kernel[...] + layer.bias[...]


def layer_norm(ln, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + ln.epsilon) * ln.scale[...] + ln.bias[...]


def hand_transformer(model, x, site):
    for i, block in enumerate(model.blocks):
        p = f"blocks.{i}"
        a = block.attn
        h = site(f"{p}.ln", layer_norm(block.ln, x))
        q = site(f"{p}.attn.q_proj", lin(a.q_proj, h))
        k = site(f"{p}.attn.k_proj", lin(a.k_proj, h))
        v = site(f"{p}.attn.v_proj", lin(a.v_proj, h))
        w = jax.nn.softmax(q @ k.T / np.sqrt(D), axis=-1)
        x = x + site(f"{p}.attn", site(f"{p}.attn.out", lin(a.out, w @ v)))
        x = site(p, x + jax.nn.gelu(site(f"{p}.mlp", lin(block.mlp, x))))
    return site("head", lin(model.head, x))


@pytest.fixture(scope="module")
def transformer():
    return Transformer(D, 2, nnx.Rngs(0))


X = jax.random.normal(jax.random.key(1), (T, D))


def test_nnx_outputs_are_bit_identical(transformer):
    model = instrument(transformer)
    assert np.array_equal(model(X), transformer(X))
    assert np.array_equal(jax.jit(lambda x: model(x))(X), jax.jit(lambda x: transformer(x))(X))


def test_instrumented_programs_carry_no_effect(transformer):
    # Sites that replace a value that flows on need no effect, so jit keeps its
    # fast dispatch and the program is the model's own.
    closed = jax.make_jaxpr(instrument(transformer))(X)
    assert not closed.effects and sum(e.primitive.name == "sow" for e in closed.jaxpr.eqns) == 17


def test_nnx_reap_every_submodule(transformer):
    model = instrument(transformer)
    reaped = reap(model, tag="modules")(X)
    rec = Recorder()
    hand_transformer(transformer, X, rec)
    assert sorted(reaped) == sorted(rec.values)
    for name, value in rec.values.items():
        np.testing.assert_allclose(reaped[name], value, **TOL, err_msg=name)
    # The containers are not sites; their elements are, by index.
    assert "blocks" not in reaped and "blocks.1.attn.q_proj" in reaped


@pytest.mark.parametrize(
    "name", ["blocks.0.attn", "blocks.0.attn.q_proj", "blocks.1.ln", "blocks.0"]
)
def test_nnx_plant_changes_everything_downstream(transformer, name):
    model = instrument(transformer)
    shape = reap(model, tag="modules")(X)[name].shape
    patch = jnp.linspace(-1.0, 1.0, int(np.prod(shape))).reshape(shape)
    out, reaps = jax.jit(lambda x: _harvest(model, {name: patch}, x))(X)
    rec = Recorder({name: patch})
    expected = hand_transformer(transformer, X, rec)
    np.testing.assert_allclose(out, expected, **TOL)
    for other, value in rec.values.items():
        if other != name:
            np.testing.assert_allclose(reaps[other], value, **TOL, err_msg=other)


def _harvest(model, plants, x):
    from harvest import harvest

    return harvest(model, tag="modules")(plants, x)


def test_nnx_grad_and_vmap(transformer):
    model = instrument(transformer)
    xs = jax.random.normal(jax.random.key(2), (3, T, D))

    def hand_site(x, name):
        rec = Recorder()
        hand_transformer(transformer, x, rec)
        return rec.values[name]

    got = jax.vmap(reap(model, tag="modules"))(xs)["blocks.1.attn"]
    np.testing.assert_allclose(got, jax.vmap(lambda x: hand_site(x, "blocks.1.attn"))(xs), **TOL)
    got = jax.grad(lambda x: reap(model, tag="modules")(x)["blocks.0.mlp"].sum())(X)
    want = jax.grad(lambda x: hand_site(x, "blocks.0.mlp").sum())(X)
    np.testing.assert_allclose(got, want, **TOL)
    # Gradient through a plant: d(output)/d(planted value).
    zero = jnp.zeros((T, D))
    got = jax.grad(lambda v: plant(model, tag="modules")({"blocks.1.attn": v}, X).sum())(zero)
    want = jax.grad(
        lambda v: hand_transformer(transformer, X, Recorder({"blocks.1.attn": v})).sum()
    )(zero)
    np.testing.assert_allclose(got, want, **TOL)


def test_nnx_sites_sweep_and_attribution(transformer):
    model = instrument(transformer)
    corrupted = X[::-1]
    clean = reap(model, tag="modules")(X)
    names = ["blocks.0", "blocks.1.attn"]
    info = {s.name: s for s in sites(model, tag="modules")(X)}
    assert info["blocks.0"].shape == (T, D) and info["head"].fires == 1

    def metric(y):
        return y[:, 0].sum()

    r = patching_sweep(model, clean, (corrupted,), metric, tag="modules", names=names, axis=0)
    for i, name in enumerate(names):
        for t in range(T):
            rec = Recorder()
            hand_transformer(transformer, corrupted, rec)
            row = rec.values[name].at[t].set(clean[name][t])
            want = metric(hand_transformer(transformer, corrupted, Recorder({name: row})))
            np.testing.assert_allclose(r.values[i, t] + r.baseline, want, rtol=1e-4, atol=1e-4)
    a = attribution_patching(model, clean, (corrupted,), metric, tag="modules", names=names, axis=0)
    assert a.values.shape == (2, T) and np.isfinite(a.values).all()


def test_where_selects_before_tracing(transformer):
    model = instrument(transformer, names=["blocks.*.attn", "head"])
    assert sorted(reap(model, tag="modules")(X)) == ["blocks.0.attn", "blocks.1.attn", "head"]
    model = instrument(transformer, names=lambda name: name.endswith("q_proj"))
    assert sorted(reap(model, tag="modules")(X)) == ["blocks.0.attn.q_proj", "blocks.1.attn.q_proj"]
    with pytest.raises(ValueError, match="selects none of the model's submodules.*'blocks.0'"):
        instrument(transformer, names="decoder.*")(X)


def test_exclude_leaves_out_what_names_would_leave_out(transformer):
    # `exclude=` is `names=` of the complement, as in reap: same sites, same values.
    every = reap(instrument(transformer), tag="modules")(X)
    out = lambda name: name.startswith("blocks.1") or name == "head"  # noqa: E731
    kept = reap(instrument(transformer, exclude=["blocks.1*", "head"]), tag="modules")(X)
    by_names = reap(instrument(transformer, names=lambda n: not out(n)), tag="modules")(X)
    assert sorted(kept) == sorted(n for n in every if not out(n)) == sorted(by_names)
    for name in kept:
        np.testing.assert_array_equal(kept[name], every[name])


# ---------------------------------------------------------------------------
# Repeated calls: a shared module, a module inside scan.


class Shared(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.lin(jnp.tanh(self.lin(x)))))


def test_shared_module_stacks_its_calls():
    shared = Shared(nnx.Rngs(3))
    model = instrument(shared)
    reaped = reap(model, tag="modules")(X)
    first = lin(shared.lin, X)
    second = lin(shared.lin, jnp.tanh(first))
    np.testing.assert_allclose(reaped["lin"], jnp.stack([first, second]), **TOL)
    assert reaped["head"].shape == (T, 1)
    # Plant one value for every call, or one per call.
    v = jnp.full((T, D), 0.5)
    want = lin(shared.head, jnp.tanh(v))
    np.testing.assert_allclose(plant(model, tag="modules")({"lin": v}, X), want, **TOL)
    stacked = jnp.stack([v, 2 * v])
    want = lin(shared.head, jnp.tanh(2 * v))
    np.testing.assert_allclose(plant(model, tag="modules")({"lin": stacked}, X), want, **TOL)


class Scanned(nnx.Module):
    def __init__(self, rngs):
        self.cell = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, xs):
        def step(h, x):
            h = jnp.tanh(self.cell(h) + x)
            return h, h

        return jax.lax.scan(step, jnp.zeros(D), xs)[0]


def test_module_inside_scan_stacks_per_iteration():
    scanned = Scanned(nnx.Rngs(4))
    model = instrument(scanned)
    h, hand = jnp.zeros(D), []
    for x in X:
        hand.append(lin(scanned.cell, h))
        h = jnp.tanh(hand[-1] + x)
    np.testing.assert_allclose(reap(model, tag="modules")(X)["cell"], jnp.stack(hand), **TOL)
    # Reaped through grad (the scan is linearized and partially evaluated).
    got = reap(jax.grad(lambda xs: model(xs).sum()), tag="modules")(X)["cell"]
    np.testing.assert_allclose(got, jnp.stack(hand), **TOL)
    # A stacked plant gives each iteration its row.
    rows = jnp.arange(T * D, dtype=jnp.float32).reshape(T, D) / 40.0
    h = jnp.zeros(D)
    for t, x in enumerate(X):
        h = jnp.tanh(rows[t] + x)
    np.testing.assert_allclose(plant(model, tag="modules")({"cell": rows}, X), h, **TOL)


# ---------------------------------------------------------------------------
# Through NNX transforms: scan over stacked layers, remat and jit of a submodule.

L = 3


class ScanOverLayers(nnx.Module):
    """The standard NNX pattern: layers made by `nnx.vmap`, applied by `nnx.scan`."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return nnx.Linear(D, D, rngs=rngs)

        self.layers = make(rngs)
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x, layer):
            return jnp.tanh(layer(x))

        return self.head(step(x, self.layers))


def hand_scan_over_layers(model, x, patch=None):
    """The scanned forward as a Python loop over the stacked parameters;
    `patch` maps a layer index to the value its Linear output is replaced by."""
    patch = patch or {}
    kernel, bias = model.layers.kernel.get_value(), model.layers.bias.get_value()
    outs = []
    for i in range(L):
        y = patch.get(i, x @ kernel[i] + bias[i])
        outs.append(y)
        x = jnp.tanh(y)
    return lin(model.head, x), jnp.stack(outs)


@pytest.fixture(scope="module")
def scan_model():
    return ScanOverLayers(nnx.Rngs(6))


def test_scan_over_layers_reaps_each_layer(scan_model):
    model = instrument(scan_model)
    np.testing.assert_array_equal(model(X), scan_model(X))
    out, reaped = call_and_reap(model, tag="modules")(X)
    want_out, want = hand_scan_over_layers(scan_model, X)
    assert sorted(reaped) == ["head", "layers"]
    assert reaped["layers"].shape == (L, T, D)
    np.testing.assert_allclose(reaped["layers"], want, **TOL)
    np.testing.assert_allclose(out, want_out, **TOL)
    assert not hasattr(scan_model.layers, "_harvest_instrument_paths")  # the mark lasts one call
    info = {s.name: s for s in sites(model, tag="modules")(X)}
    assert info["layers"].fires == L and info["layers"].shape == (T, D)


def test_scan_over_layers_plant_one_iteration(scan_model):
    model = instrument(scan_model)
    v = jnp.full((T, D), 0.25)
    # Layer 1 only (a callable sees the iteration); layer 2 recomputes from it.
    want, _ = hand_scan_over_layers(scan_model, X, {1: v})
    got = plant(model, tag="modules")({"layers": lambda old, i: jnp.where(i == 1, v, old)}, X)
    np.testing.assert_allclose(got, want, **TOL)
    # A stacked value: row i for layer i.
    rows = jnp.stack([v, 2 * v, -v])
    want, _ = hand_scan_over_layers(scan_model, X, {0: v, 1: 2 * v, 2: -v})
    np.testing.assert_allclose(plant(model, tag="modules")({"layers": rows}, X), want, **TOL)
    # One value for every layer.
    want, _ = hand_scan_over_layers(scan_model, X, {i: v for i in range(L)})
    np.testing.assert_allclose(plant(model, tag="modules")({"layers": v}, X), want, **TOL)


def test_scan_over_layers_under_jit_and_grad(scan_model):
    model = instrument(scan_model)
    got = jax.jit(reap(model, tag="modules"))(X)["layers"]
    np.testing.assert_allclose(got, hand_scan_over_layers(scan_model, X)[1], **TOL)
    got = jax.grad(lambda x: reap(model, tag="modules")(x)["layers"][2].sum())(X)
    want = jax.grad(lambda x: hand_scan_over_layers(scan_model, x)[1][2].sum())(X)
    np.testing.assert_allclose(got, want, **TOL)
    # Gradient through a plant into the middle layer.
    _, clean = hand_scan_over_layers(scan_model, X)
    middle = lambda v: {"layers": lambda old, i: jnp.where(i == 1, v, old)}  # noqa: E731
    got = jax.grad(lambda v: plant(model, tag="modules")(middle(v), X).sum())(clean[1])
    want = jax.grad(lambda v: hand_scan_over_layers(scan_model, X, {1: v})[0].sum())(clean[1])
    np.testing.assert_allclose(got, want, **TOL)


def test_scan_over_layers_sweep_gives_a_row_per_layer(scan_model):
    model = instrument(scan_model)
    corrupted = X[::-1]
    clean = reap(model, tag="modules")(X)

    def metric(y):
        return y.sum()

    r = patching_sweep(model, clean, (corrupted,), metric, tag="modules", names=["layers"])
    assert list(r.names) == [f"layers[{i}]" for i in range(L)]
    _, corrupt_layers = hand_scan_over_layers(scan_model, corrupted)
    for i in range(L):
        # Patching one layer's output by hand; later layers recompute from it.
        want = metric(hand_scan_over_layers(scan_model, corrupted, {i: clean["layers"][i]})[0])
        np.testing.assert_allclose(r.values[i] + r.baseline, want, rtol=1e-4, atol=1e-4)
    a = attribution_patching(model, clean, (corrupted,), metric, tag="modules", names=["layers"])
    assert list(a.names) == list(r.names)
    for i in range(L):
        g = jax.grad(lambda v: metric(hand_scan_over_layers(scan_model, corrupted, {i: v})[0]))(
            corrupt_layers[i]
        )
        want = jnp.vdot(g, clean["layers"][i] - corrupt_layers[i])
        np.testing.assert_allclose(a.values[i], want, rtol=1e-4, atol=1e-4)


class Holder(nnx.Module):
    def __init__(self, inner):
        self.inner = inner

    def __call__(self, x):
        return self.inner(x)


def test_two_roots_sharing_scanned_layers_in_threads(scan_model):
    # The same stacked layers are "layers" from one root and "inner.layers" from
    # the other; each thread's calls (traced anew by `sites`) keep their own name.
    direct, held = instrument(scan_model), instrument(Holder(scan_model))
    done = threading.Event()
    found = []

    def held_calls():
        while not done.is_set() or len(found) < 3:
            found.append(tuple(sites(held, tag="modules")(X).names()))

    thread = threading.Thread(target=held_calls)
    thread.start()
    mine = {tuple(sites(direct, tag="modules")(X).names()) for _ in range(4)}
    done.set()
    thread.join()
    assert mine == {("layers", "head")} and set(found) == {("inner.layers", "inner.head", "inner")}
    assert not hasattr(scan_model.layers, "_harvest_instrument_paths")


class WrappedCalls(nnx.Module):
    """Submodules called through `nnx.remat`, `nnx.jit` and `nnx.vmap`."""

    def __init__(self, rngs):
        self.first = nnx.Linear(D, D, rngs=rngs)
        self.second = nnx.Linear(D, D, rngs=rngs)
        self.third = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(nnx.remat(lambda m, x: m(x))(self.first, x))
        h = jnp.tanh(nnx.jit(lambda m, x: m(x))(self.second, h))
        return nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(self.third, h)


def hand_wrapped(model, x, patch=None):
    patch = patch or {}
    values = {}
    for name in ("first", "second", "third"):
        y = patch.get(name, lin(getattr(model, name), x))
        values[name] = y
        x = jnp.tanh(y)
    return values["third"], values


def test_remat_jit_and_vmap_wrapped_submodule_calls():
    wrapped = WrappedCalls(nnx.Rngs(7))
    model = instrument(wrapped)
    out, reaped = call_and_reap(model, tag="modules")(X)
    want_out, want = hand_wrapped(wrapped, X)
    np.testing.assert_allclose(out, want_out, **TOL)
    assert sorted(reaped) == ["first", "second", "third"]
    for name in want:
        np.testing.assert_allclose(reaped[name], want[name], **TOL, err_msg=name)
    v = jnp.full((T, D), -0.5)
    np.testing.assert_allclose(
        plant(model, tag="modules")({"first": v}, X),
        hand_wrapped(wrapped, X, {"first": v})[0],
        **TOL,
    )
    v = jnp.full((T, D), 0.5)
    np.testing.assert_allclose(
        plant(model, tag="modules")({"second": v}, X),
        hand_wrapped(wrapped, X, {"second": v})[0],
        **TOL,
    )
    np.testing.assert_array_equal(model(X), wrapped(X))
    assert not hasattr(wrapped.second, "_harvest_instrument_paths")  # the mark lasts one call


# ---------------------------------------------------------------------------
# Equinox.


class EqxMLP(eqx.Module):
    layers: list
    out: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.layers = [eqx.nn.Linear(D, D, key=k) for k in keys[:3]]
        self.out = eqx.nn.Linear(D, 2, key=keys[3])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return self.out(x)


def hand_eqx(model, x, site):
    for i, layer in enumerate(model.layers):
        x = jax.nn.relu(site(f"layers.{i}", layer.weight @ x + layer.bias))
    return site("out", model.out.weight @ x + model.out.bias)


def test_equinox_reap_and_plant():
    mlp = EqxMLP(jax.random.key(5))
    model = instrument(mlp)
    x = X[0]
    assert np.array_equal(model(x), mlp(x))
    rec = Recorder()
    hand_eqx(mlp, x, rec)
    reaped = reap(model, tag="modules")(x)
    assert sorted(reaped) == ["layers.0", "layers.1", "layers.2", "out"]
    for name, value in rec.values.items():
        np.testing.assert_allclose(reaped[name], value, **TOL)
    patch = jnp.linspace(-1.0, 1.0, D)
    want = hand_eqx(mlp, x, Recorder({"layers.1": patch}))
    np.testing.assert_allclose(
        jax.jit(plant(model, tag="modules"))({"layers.1": patch}, x), want, **TOL
    )
    # The model is data: under eqx.filter_jit and vmap, and as an argument.
    batched = jax.vmap(reap(model, tag="modules"))(X)["layers.2"]
    np.testing.assert_allclose(
        batched, jax.vmap(lambda x: _hand_site(hand_eqx, mlp, x, "layers.2"))(X), **TOL
    )
    reaped = eqx.filter_jit(lambda m, x: reap(m, tag="modules")(x))(model, x)
    np.testing.assert_allclose(reaped["out"], rec.values["out"], **TOL)


class EqxBlock(eqx.Module):
    ln: eqx.nn.LayerNorm
    mlp: eqx.nn.Linear

    def __init__(self, key):
        self.ln = eqx.nn.LayerNorm(D)
        self.mlp = eqx.nn.Linear(D, D, key=key)

    def __call__(self, x):
        return x + self.mlp(self.ln(x))


class EqxScanOverLayers(eqx.Module):
    """Equinox's scan over layers: stacked by `eqx.filter_vmap`, each rebuilt by `eqx.combine`."""

    layers: EqxBlock
    head: eqx.nn.Linear  # shaped like one layer's mlp

    def __init__(self, key):
        keys = jax.random.split(key, L + 1)
        self.layers = eqx.filter_vmap(EqxBlock)(keys[:L])
        self.head = eqx.nn.Linear(D, D, key=keys[L])

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(x, params):
            return eqx.combine(params, static)(x), None

        x, _ = jax.lax.scan(step, x, dynamic)
        return self.head(x)


def hand_eqx_scan(model, x, patch=None):
    """The scan written as a Python loop over the stacked arrays; `patch` maps
    a layer index to the value that layer's output is replaced by."""
    patch = patch or {}
    w = model.layers
    values = {"layers.ln": [], "layers.mlp": [], "layers": []}
    for i in range(L):
        mean, var = x.mean(), x.var()
        ln = (x - mean) / jnp.sqrt(var + 1e-5) * w.ln.weight[i] + w.ln.bias[i]
        mlp = w.mlp.weight[i] @ ln + w.mlp.bias[i]
        x = patch.get(i, x + mlp)
        for name, v in (("layers.ln", ln), ("layers.mlp", mlp), ("layers", x)):
            values[name].append(v)
    out = model.head.weight @ x + model.head.bias
    return out, {"head": out, **{k: jnp.stack(v) for k, v in values.items()}}


@pytest.fixture(scope="module")
def eqx_scan():
    return EqxScanOverLayers(jax.random.key(8))


def test_equinox_scan_over_layers_reaps_each_layer(eqx_scan):
    model = instrument(eqx_scan)
    x = X[0]
    np.testing.assert_array_equal(model(x), eqx_scan(x))
    out, reaped = call_and_reap(model, tag="modules")(x)
    want_out, want = hand_eqx_scan(eqx_scan, x)
    assert list(reaped) == ["layers.ln", "layers.mlp", "layers", "head"]  # program order
    np.testing.assert_allclose(out, want_out, **TOL)
    for name in want:
        np.testing.assert_allclose(reaped[name], want[name], **TOL, err_msg=name)
    assert reaped["layers"].shape == (L, D)
    got = jax.jit(reap(model, tag="modules"))(x)["layers.mlp"]
    np.testing.assert_allclose(got, want["layers.mlp"], **TOL)
    got = jax.grad(lambda x: reap(model, tag="modules")(x)["layers"][1].sum())(x)
    np.testing.assert_allclose(
        got, jax.grad(lambda x: hand_eqx_scan(eqx_scan, x)[1]["layers"][1].sum())(x), **TOL
    )
    # Batched the Equinox way: vmap over examples.
    got = jax.vmap(reap(model, tag="modules"))(X)["layers"]
    np.testing.assert_allclose(
        got, jax.vmap(lambda x: hand_eqx_scan(eqx_scan, x)[1]["layers"])(X), **TOL
    )


def test_equinox_scan_over_layers_plant_and_sweep(eqx_scan):
    model = instrument(eqx_scan)
    x, corrupted = X[0], X[1]
    v = jnp.full(D, 0.5)
    want, _ = hand_eqx_scan(eqx_scan, x, {1: v})
    got = plant(model, tag="modules")({"layers": lambda old, i: jnp.where(i == 1, v, old)}, x)
    np.testing.assert_allclose(got, want, **TOL)
    rows = jnp.stack([v, -v, 2 * v])
    want, _ = hand_eqx_scan(eqx_scan, x, {0: v, 1: -v, 2: 2 * v})
    np.testing.assert_allclose(plant(model, tag="modules")({"layers": rows}, x), want, **TOL)
    clean = reap(model, tag="modules")(x)
    r = patching_sweep(model, clean, (corrupted,), jnp.sum, tag="modules", names=["layers"])
    assert list(r.names) == [f"layers[{i}]" for i in range(L)]
    for i in range(L):
        want = hand_eqx_scan(eqx_scan, corrupted, {i: clean["layers"][i]})[0].sum()
        np.testing.assert_allclose(r.values[i] + r.baseline, want, rtol=1e-4, atol=1e-4)


class TwoStacks(eqx.Module):
    enc: eqx.nn.Linear
    dec: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.enc = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(jax.random.split(k1, L))
        self.dec = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(jax.random.split(k2, L))
        self.head = eqx.nn.Linear(D, 1, key=k3)

    def __call__(self, x):
        for stack in (self.enc, self.dec):  # the module itself scanned over, as `xs`
            x, _ = jax.lax.scan(lambda x, layer: (jnp.tanh(layer(x)), None), x, stack)
        return self.head(x)


def test_equinox_rebuilt_layer_that_fits_two_stacks_is_an_error():
    model = TwoStacks(jax.random.key(9))
    with pytest.raises(
        ValueError,
        match=r"fits several of the model's submodules: 'enc', 'dec'.*exclude=\[.enc., .dec.\]",
    ):
        reap(instrument(model), tag="modules")(X[0])
    # Left out by `where`, they are not sites, and the rest still is.
    cache = reap(instrument(model, names="head"), tag="modules")(X[0])
    np.testing.assert_allclose(cache["head"], model(X[0]), **TOL)


def _hand_site(hand, model, x, name):
    rec = Recorder()
    hand(model, x, rec)
    return rec.values[name]


# ---------------------------------------------------------------------------
# The interception is scoped to the call.


def test_classes_are_restored_and_calls_nest(transformer):
    before = {
        cls: cls.__dict__.get("__call__") for cls in (nnx.Linear, nnx.LayerNorm, Block, Attention)
    }
    inner = instrument(transformer, tag="inner")

    class Outer(nnx.Module):
        def __init__(self):
            self.pre = nnx.Linear(D, D, rngs=nnx.Rngs(7))

        def __call__(self, x):
            return inner(self.pre(x))

    outer = instrument(Outer())
    # An instrumented model called inside another's call: each sows its own paths.
    out, reaped = call_and_reap(outer, tag="modules")(X)
    assert list(reaped) == ["pre"]
    np.testing.assert_allclose(out, transformer(reaped["pre"]), **TOL)
    assert len(reap(outer, tag="inner")(X)) == 17
    assert {cls: cls.__dict__.get("__call__") for cls in before} == before
    assert np.array_equal(transformer(X), instrument(transformer)(X))


def test_other_threads_see_the_plain_model(transformer):
    # Both threads trace (sites never hits a cache) while the other one runs.
    model = instrument(transformer)
    done = threading.Event()
    found = []

    def plain_calls():
        while not done.is_set() or len(found) < 3:
            found.append(len(sites(lambda x: transformer(x))(X)))

    thread = threading.Thread(target=plain_calls)
    thread.start()
    mine = [len(sites(model, tag="modules")(X)) for _ in range(4)]
    done.set()
    thread.join()
    assert mine == [17] * 4 and set(found) == {0}


# ---------------------------------------------------------------------------
# Bad input.


def test_bad_targets_and_outputs():
    with pytest.raises(TypeError, match="Equinox module, a Penzai layer or a callable, got a int"):
        instrument(3)

    class Labels(nnx.Module):
        def __call__(self, x):
            return "label"

    class Model(nnx.Module):
        def __init__(self):
            self.labels = Labels()

        def __call__(self, x):
            self.labels(x)
            return 2.0 * x

    shared = Shared(nnx.Rngs(10))
    # One module called on two shapes: its occurrences cannot be stacked.
    with pytest.raises(ValueError, match=r"(?s)name='lin'.*different shapes \(\[3, 8\], \[8\]\)"):
        reap(lambda x: instrument(shared)(x) + instrument(shared)(x[0])[0], tag="modules")(X[:3])

    with pytest.raises(TypeError, match="module at 'labels' returned its output of type str"):
        instrument(Model())(X)
    model = instrument(Model(), names=lambda n: n != "labels", ops=True)
    assert list(reap(model, tag="modules")(X)) == ["mul:0"]
    with pytest.raises(ValueError, match="names='head' selected nothing"):
        instrument(Model(), names="head", ops=True)(X)


def test_reap_and_plant_without_the_modules_tag_say_to_pass_it(transformer):
    model = instrument(transformer)
    hint = r"has sows of the tags 'modules'\. Pass one of those as tag="
    with pytest.raises(ValueError, match=r"reap\(tag='intermediates'\).*" + hint):
        reap(model)(X)
    with pytest.raises(ValueError, match=r"plant\(tag='intermediates'\).*" + hint):
        plant(model)({"head": jnp.zeros((T, 2))}, X)
    # Planting nothing under another tag is still the model itself.
    np.testing.assert_allclose(plant(model)({}, X), transformer(X), rtol=1e-5, atol=1e-6)


def test_reap_and_plant_of_a_model_never_instrumented_say_to_instrument_it(transformer):
    # The README names both `mlp` and `model`: reaping the one never passed to
    # instrument was {} (NNX and Equinox alike), planting it "Names sown: none".
    mlp = eqx.nn.MLP(D, 3, 4, 1, key=jax.random.key(2))
    for plain, name, x in ((transformer, "head", X), (mlp, "layers.1", X[0])):
        with pytest.raises(ValueError, match=r"reap\(tag='modules'\).*sows nothing.*instrument"):
            reap(plain, tag="modules")(x)
        with pytest.raises(ValueError, match=r"plant\(tag='modules'\).*instrument\(model\)"):
            plant(plain, tag="modules")({name: jnp.zeros(plain(x).shape)}, x)
        # Instrumented, the same call reaps the sites the hand-written forward has.
        recorder = Recorder()
        if plain is transformer:
            hand_transformer(transformer, X, recorder)
            assert set(reap(instrument(plain), tag="modules")(X)) == set(recorder.values)
        else:
            reaped = reap(instrument(plain), tag="modules")(X[0])
            np.testing.assert_allclose(reaped["layers.1"], mlp(X[0]), **TOL)
    # A function that sows nothing, reaped under another tag, is still {}.
    assert reap(lambda x: x * 2.0)(1.0) == {}


# ---------------------------------------------------------------------------
# Linen, through its own method interception.

nn = pytest.importorskip("flax.linen")


class LinenAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k = nn.Dense(D, name="q")(x), nn.Dense(D, name="k")(x)
        return nn.Dense(D, name="o")(jax.nn.softmax(q @ k.T) @ x)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + LinenAttention(name="attn")(nn.LayerNorm(name="ln")(x))


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = LinenBlock(name=f"blocks_{i}")(x)
        return nn.Dense(2, name="head")(x)


def hand_linen(params, x, site):
    def dense(p, x):
        return x @ p["kernel"] + p["bias"]

    for i in range(2):
        p = params[f"blocks_{i}"]
        name = f"blocks_{i}"
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        h = site(
            f"{name}.ln", (x - mean) / jnp.sqrt(var + 1e-6) * p["ln"]["scale"] + p["ln"]["bias"]
        )
        a = p["attn"]
        q, k = site(f"{name}.attn.q", dense(a["q"], h)), site(f"{name}.attn.k", dense(a["k"], h))
        o = site(f"{name}.attn.o", dense(a["o"], jax.nn.softmax(q @ k.T) @ h))
        x = site(name, x + site(f"{name}.attn", o))
    return site("head", dense(params["head"], x))


def test_linen_modules_applied_in_a_function():
    module = LinenModel()
    variables = module.init(jax.random.key(8), X)
    f = instrument(lambda x: module.apply(variables, x))
    assert np.array_equal(f(X), module.apply(variables, X))
    rec = Recorder()
    hand_linen(variables["params"], X, rec)
    reaped = reap(f, tag="modules")(X)
    assert sorted(reaped) == sorted(rec.values)
    for name, value in rec.values.items():
        np.testing.assert_allclose(reaped[name], value, **TOL, err_msg=name)
    patch = jnp.ones((T, D))
    want = hand_linen(variables["params"], X, Recorder({"blocks_0.attn": patch}))
    np.testing.assert_allclose(
        jax.jit(plant(f, tag="modules"))({"blocks_0.attn": patch}, X), want, **TOL
    )
    # The variables as an argument, under vmap.
    g = instrument(module.apply)
    got = jax.vmap(reap(g, tag="modules"), in_axes=(None, 0))(variables, X[:, None, :])[
        "blocks_1.attn.q"
    ]
    rec = Recorder()
    hand_linen(variables["params"], X[:, None, :][0], rec)
    np.testing.assert_allclose(got[0], rec.values["blocks_1.attn.q"], **TOL)


def test_function_without_linen_modules_needs_ops():
    with pytest.raises(ValueError, match="applies no Flax Linen module.*ops=True"):
        instrument(jnp.sin)(X)
    # A function calling an NNX model: the message says to pass the model itself.
    model = Transformer(D, 1, nnx.Rngs(3))
    with pytest.raises(ValueError, match="instrument the model object itself"):
        instrument(lambda x: model(x))(X)


def test_a_module_class_or_an_unbound_linen_module_is_refused_at_instrument_time():
    # Each was accepted and failed at the first call in another library's words
    # (Flax's CallCompactUnboundModuleError, a missing __init__ argument).
    module = LinenModel()
    variables = module.init(jax.random.key(8), X)
    with pytest.raises(TypeError, match=r"unbound Flax Linen module \(LinenModel\).*model\.apply"):
        instrument(module)
    for cls, library in ((eqx.nn.MLP, "Equinox"), (nnx.Linear, "Flax NNX")):
        with pytest.raises(
            TypeError, match=rf"{library} class {cls.__name__}, not a model.*\(\.\.\.\)"
        ):
            instrument(cls)
    with pytest.raises(TypeError, match=r"Linen class LinenModel.*\.apply\(variables, x\)"):
        instrument(LinenModel)
    # What the messages say to pass works, against the function without harvest.
    bound = instrument(module.bind(variables))
    np.testing.assert_array_equal(bound(X), module.apply(variables, X))
    rec = Recorder()
    hand_linen(variables["params"], X, rec)
    np.testing.assert_allclose(reap(bound, tag="modules")(X)["head"], rec.values["head"], **TOL)
    mlp = eqx.nn.MLP(D, 3, 4, 1, key=jax.random.key(2))
    np.testing.assert_allclose(reap(instrument(mlp), tag="modules")(X[0])["layers.1"], mlp(X[0]))


# ---------------------------------------------------------------------------
# ops=True: every primitive's output.


def scan_and_cond(x, xs):
    def body(c, x):
        with jax.named_scope("cell"):
            c = jnp.tanh(c * 0.5 + x)
        return c, c * 2.0

    c, ys = jax.lax.scan(body, x, xs)
    return jax.lax.cond(c.sum() > 0, jnp.sin, jnp.cos, ys).sum()


def hand_scan_and_cond(x, xs, cell=None):
    c, muls, cells, ys = x, [], [], []
    for t, x_t in enumerate(xs):
        muls.append(c * 0.5)
        c = jnp.tanh(muls[-1] + x_t) if cell is None else cell[t]
        cells.append(c)
        ys.append(c * 2.0)
    ys = jnp.stack(ys)
    taken = c.sum() > 0
    return dict(
        muls=jnp.stack(muls),
        cells=jnp.stack(cells),
        ys=ys,
        taken=taken,
        out=(jnp.sin(ys) if taken else jnp.cos(ys)).sum(),
    )


XS = jax.random.normal(jax.random.key(9), (4, 3))
X0 = jnp.array([0.3, -0.2, 0.9])


def test_ops_inside_scan_and_cond():
    f = instrument(scan_and_cond, ops=True)
    assert np.array_equal(f(X0, XS), scan_and_cond(X0, XS))
    assert np.array_equal(jax.jit(f)(X0, XS), jax.jit(scan_and_cond)(X0, XS))
    names = sites(f, tag="modules")(X0, XS).names()
    assert (
        names == sites(instrument(scan_and_cond, ops=True), tag="modules")(X0, XS).names()
    )  # stable
    assert {"cell/mul:0", "cell/tanh:0", "mul:0", "sin:0", "cos:0", "scan:0", "cond:0"} <= set(
        names
    )
    reaped = reap(f, tag="modules")(X0, XS)
    hand = hand_scan_and_cond(X0, XS)
    np.testing.assert_allclose(reaped["cell/mul:0"], hand["muls"], **TOL)  # stacked per iteration
    np.testing.assert_allclose(reaped["cell/tanh:0"], hand["cells"], **TOL)
    np.testing.assert_allclose(reaped["mul:0"], hand["ys"], **TOL)
    taken, other = ("sin:0", "cos:0") if hand["taken"] else ("cos:0", "sin:0")
    np.testing.assert_allclose(
        reaped[taken], (jnp.sin if hand["taken"] else jnp.cos)(hand["ys"]), **TOL
    )
    np.testing.assert_array_equal(reaped[other], 0.0)  # the branch not taken
    # A plant of an op inside the scan: one value for every iteration, or one row each.
    v = jnp.array([0.1, 0.2, -0.3])
    got = plant(f, tag="modules")({"cell/tanh:0": v}, X0, XS)
    np.testing.assert_allclose(got, hand_scan_and_cond(X0, XS, cell=[v] * 4)["out"], **TOL)
    rows = XS[::-1]
    got = jax.jit(plant(f, tag="modules"))({"cell/tanh:0": rows}, X0, XS)
    np.testing.assert_allclose(got, hand_scan_and_cond(X0, XS, cell=rows)["out"], **TOL)
    np.testing.assert_allclose(jax.grad(f)(X0, XS), jax.grad(scan_and_cond)(X0, XS), **TOL)


def test_ops_inside_jit_checkpoint_and_while():
    @jax.jit
    def inner(x):
        return jnp.exp(x) * 3.0

    def f(x, n):
        y = jax.checkpoint(lambda z: jnp.sin(z) * 2.0)(inner(x))
        return jax.lax.fori_loop(0, n, lambda i, c: c * 0.5 + y, y)

    g = instrument(f, ops=True)
    n = jnp.int32(3)
    reaped = reap(g, tag="modules")(X0, n)
    y = jnp.sin(jnp.exp(X0) * 3.0) * 2.0
    np.testing.assert_allclose(
        reaped["inner/exp:0"], jnp.exp(X0), **TOL
    )  # jit bodies under their name
    np.testing.assert_allclose(
        reaped["sin:0"], jnp.sin(jnp.exp(X0) * 3.0), **TOL
    )  # inside checkpoint
    c = y
    for _ in range(2):
        c = c * 0.5 + y
    np.testing.assert_allclose(reaped["mul:1"], c * 0.5, **TOL)  # a while body: the last iteration
    assert (
        sites(g, tag="modules")(X0, n)[5].mode == "auto"
    )  # a while body: reaped last, or per step (max_steps)
    np.testing.assert_allclose(
        jax.jacfwd(lambda x: g(x, n))(X0), jax.jacfwd(lambda x: f(x, n))(X0), **TOL
    )


def test_ops_python_arguments_stay_static():
    def f(x, times, square=False):
        for _ in range(times):
            x = x * x if square else x + 1.0
        return x

    g = instrument(f, ops=True)
    assert np.array_equal(g(X0, 2, square=True), f(X0, 2, square=True))
    assert sorted(reap(lambda x: g(x, 2, square=True), tag="modules")(X0)) == ["mul:0", "mul:1"]
    assert sorted(reap(lambda x: g(x, 3), tag="modules")(X0)) == ["add:0", "add:1", "add:2"]
    # reap's own calling convention keeps them Python values too.
    assert sorted(reap(g, tag="modules")(X0, 2, square=True)) == ["mul:0", "mul:1"]
    np.testing.assert_allclose(plant(g, tag="modules")({"add:2": X0}, X0, 3), X0)


def test_ops_named_by_module_path(transformer):
    model = instrument(transformer, ops=True, names="blocks.0.attn.q_proj*")
    reaped = reap(model, tag="modules")(X)
    rec = Recorder()
    hand_transformer(transformer, X, rec)
    ln = rec.values["blocks.0.ln"]
    np.testing.assert_allclose(
        reaped["blocks.0.attn.q_proj/dot_general:0"],
        ln @ transformer.blocks[0].attn.q_proj.kernel[...],
        **TOL,
    )
    np.testing.assert_allclose(
        reaped["blocks.0.attn.q_proj"], rec.values["blocks.0.attn.q_proj"], **TOL
    )
    # Names do not depend on `where`.
    every = reap(instrument(transformer, ops=True), tag="modules")(X)
    assert set(reaped) <= set(every) and len(every) > 100


def test_direct_call_has_the_model_s_state_effects():
    # The instrumented call runs the user's own objects: batch statistics and
    # RNG counters move exactly as in a direct call.
    class Stateful(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(D, D, rngs=rngs)
            self.bn = nnx.BatchNorm(D, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.bn(self.lin(x)))

    model, twin = Stateful(nnx.Rngs(11)), Stateful(nnx.Rngs(11))
    probed = instrument(model)
    for _ in range(2):
        np.testing.assert_array_equal(probed(X), twin(X))
    for kind in (nnx.BatchStat, nnx.RngCount):
        for a, b in zip(
            jax.tree_util.tree_leaves(nnx.state(model, kind)),
            jax.tree_util.tree_leaves(nnx.state(twin, kind)),
        ):
            np.testing.assert_array_equal(a, b)
    assert int(jax.tree_util.tree_leaves(nnx.state(model, nnx.RngCount))[0]) == 2


# ---------------------------------------------------------------------------
# Stateful submodules called through nnx.jit and nnx.remat, under outer transformations.


class ThroughTransforms(nnx.Module):
    """BatchNorm, Dropout and Linears, each called through `nnx.remat` or `nnx.jit`."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.bn = nnx.BatchNorm(D, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        h = nnx.remat(lambda m, x: m(x))(self.lin, x)
        h = nnx.jit(lambda m, x: m(x))(self.bn, h)
        h = nnx.jit(lambda m, x: m(x))(self.drop, h)
        return nnx.jit(lambda m, x: m(x))(self.out, h)


class HandSownThrough(ThroughTransforms):
    """The same model with its sows written by hand, some inside the NNX transforms."""

    def __call__(self, x):
        def sown(name):
            return lambda m, x: sow(m(x), name=name, tag="modules", mode="strict")

        h = nnx.remat(sown("lin"))(self.lin, x)
        h = sow(nnx.jit(lambda m, x: m(x))(self.bn, h), name="bn", tag="modules", mode="strict")
        h = nnx.jit(sown("drop"))(self.drop, h)
        return nnx.jit(sown("out"))(self.out, h)


PARTS = ("lin", "bn", "drop", "out")
V = jnp.linspace(-1.0, 1.0, T * D).reshape(T, D)


def hand_through(model, x, patch=None):
    """The forward pass written out: each submodule called directly, `patch` substituted."""
    patch = patch or {}
    values = {}
    for name in PARTS:
        x = values[name] = patch.get(name, getattr(model, name)(x))
    return x, values


def _reaped_but(result, planted):
    out, values = result
    return out, {k: v for k, v in values.items() if k != planted}


def _target(model):
    return model if isinstance(model, HandSownThrough) else instrument(model)


HARVESTS = {  # (the harvested call, the same by hand), each f(model, x, v) -> (out, reaped)
    "reap": (
        lambda m, x, v: call_and_reap(_target(m), tag="modules")(x),
        lambda m, x, v: hand_through(m, x),
    ),
    "plant": (
        lambda m, x, v: (plant(_target(m), tag="modules")({"lin": v}, x), {}),
        lambda m, x, v: (hand_through(m, x, {"lin": v})[0], {}),
    ),
    "harvest": (
        lambda m, x, v: _harvest(_target(m), {"bn": v}, x),
        lambda m, x, v: _reaped_but(hand_through(m, x, {"bn": v}), "bn"),
    ),
}


def _under(transform, fn, model):
    """`fn(model, x, v)` under `transform`, made once so that a second call runs the
    compiled program again, as a training loop would; the model's state comes back as
    NNX transforms return it (for jax.jit: split, merged inside and returned)."""
    if transform == "eager":
        return fn
    if transform == "nnx.jit":
        return nnx.jit(fn)
    if transform == "nnx.grad":  # gradients with respect to the parameters

        def loss(m, x, v):
            result = fn(m, x, v)
            return sum(jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(result)), result

        grad = nnx.grad(loss, has_aux=True)

        def with_grads(m, x, v):
            grads, result = grad(m, x, v)
            return result, grads

        return with_grads
    graphdef, _ = nnx.split(model)

    @jax.jit
    def pure(state, x, v):
        m = nnx.merge(graphdef, state)
        result = fn(m, x, v)
        return result, nnx.state(m)

    def split_and_update(m, x, v):
        result, state = pure(nnx.split(m)[1], x, v)
        nnx.update(m, state)
        return result

    return split_and_update


def assert_same_state(a, b):
    sa, sb = nnx.state(a), nnx.state(b)
    assert jax.tree_util.tree_structure(sa) == jax.tree_util.tree_structure(sb)
    for u, w in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb)):
        if jnp.issubdtype(u.dtype, jax.dtypes.prng_key):
            u, w = jax.random.key_data(u), jax.random.key_data(w)
        np.testing.assert_allclose(u, w, **TOL)


@pytest.mark.parametrize("transform", ["eager", "nnx.jit", "jax.jit", "nnx.grad"])
@pytest.mark.parametrize("which", sorted(HARVESTS))
@pytest.mark.parametrize("cls", [ThroughTransforms, HandSownThrough])
def test_state_through_nnx_jit_and_remat_matches_a_direct_twin(cls, which, transform):
    model = cls(nnx.Rngs(0, dropout=1))
    twin = ThroughTransforms(nnx.Rngs(0, dropout=1))  # called directly, submodule by submodule
    harvested, by_hand = HARVESTS[which]
    harvested, by_hand = _under(transform, harvested, model), _under(transform, by_hand, twin)
    for step in range(2):
        got = harvested(model, X + step, V)
        want = by_hand(twin, X + step, V)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(a, b, **TOL)
        assert_same_state(model, twin)  # batch statistics, RNG counters
    # The RNG counters moved in step: the next dropout masks agree.
    np.testing.assert_allclose(model(X), twin(X), **TOL)
    assert_same_state(model, twin)


@pytest.mark.parametrize("cls", [ThroughTransforms, HandSownThrough])
def test_through_nnx_jit_and_remat_inside_outer_jit_and_grad(cls):
    # A model that only reads its state, closed over by jax.jit and jax.grad:
    # what nnx.jit and nnx.remat hand back is a copy, not a change, so nothing
    # is written back into the model from inside the outer trace.
    model = cls(nnx.Rngs(0, dropout=1))
    model.eval()
    twin = ThroughTransforms(nnx.Rngs(0, dropout=1))
    twin.eval()
    target = _target(model)
    out, reaped = jax.jit(call_and_reap(target, tag="modules"))(X)
    want_out, want = hand_through(twin, X)
    np.testing.assert_allclose(out, want_out, **TOL)
    for name in PARTS:
        np.testing.assert_allclose(reaped[name], want[name], **TOL, err_msg=name)
    got = jax.jit(lambda x, v: plant(target, tag="modules")({"lin": v}, x))(X, V)
    np.testing.assert_allclose(got, hand_through(twin, X, {"lin": V})[0], **TOL)
    got = jax.grad(lambda x: reap(target, tag="modules")(x)["bn"].sum())(X)
    np.testing.assert_allclose(
        got, jax.grad(lambda x: hand_through(twin, x)[1]["bn"].sum())(X), **TOL
    )
    got = jax.grad(lambda v: _harvest(target, {"lin": v}, X)[0].sum())(V)
    np.testing.assert_allclose(
        got, jax.grad(lambda v: hand_through(twin, X, {"lin": v})[0].sum())(V), **TOL
    )
    assert_same_state(model, twin)


def test_a_real_change_inside_an_outer_trace_says_how_to_pass_the_model():
    # Training mode changes the batch statistics. A model made outside jax.jit
    # cannot take values of the jit's trace (a direct call fails there too);
    # the error says how to pass the model through instead.
    from flax.errors import TraceContextError

    model = ThroughTransforms(nnx.Rngs(0, dropout=1))
    twin = nnx.clone(model)
    with pytest.raises(
        TraceContextError,
        match=r"changed the NNX state \(bn.mean, bn.var, drop.rngs.count\).*Pass the model",
    ):
        jax.jit(reap(instrument(model), tag="modules"))(X)
    assert_same_state(model, twin)  # nothing was written


class TrainBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.bn = nnx.BatchNorm(D, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x, train):
        h = nnx.relu(self.bn(self.lin(x), use_running_average=not train))
        return x + self.drop(h, deterministic=not train)


class TrainScan(nnx.Module):
    """Written as NNX code usually is: layers made by nnx.vmap, applied by
    nnx.scan of an nnx.remat'd step, BatchNorm and Dropout, a `train` flag."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return TrainBlock(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, x, train=True):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def step(x, block):
            return block(x, train)

        return self.head(step(x, self.blocks))


def hand_train_scan_eval(model, x, patch=None):
    """The evaluation-mode forward written out over the stacked parameters."""
    patch = patch or {}
    b = model.blocks
    blocks = []
    for i in range(L):
        y = x @ b.lin.kernel[...][i] + b.lin.bias[...][i]
        y = (y - b.bn.mean[...][i]) / jnp.sqrt(b.bn.var[...][i] + 1e-5) * b.bn.scale[...][
            i
        ] + b.bn.bias[...][i]
        x = patch.get(i, x + jnp.maximum(y, 0.0))
        blocks.append(x)
    return lin(model.head, x), jnp.stack(blocks)


def test_nnx_scan_remat_batchnorm_dropout_with_a_train_flag():
    model, twin = TrainScan(nnx.Rngs(0, dropout=1)), TrainScan(nnx.Rngs(0, dropout=1))
    probed = instrument(model)
    for step in range(2):  # training: statistics and RNG counters move as the twin's
        out, reaped = call_and_reap(probed, tag="modules")(X + step, True)
        np.testing.assert_allclose(out, twin(X + step, True), **TOL)
        assert sorted(reaped) == ["blocks", "blocks.bn", "blocks.drop", "blocks.lin", "head"]
        assert reaped["blocks"].shape == (L, T, D)
        assert_same_state(model, twin)
    # Evaluation, under an outer jit that closes over the model (a direct call
    # could not: nnx.scan refuses a model from outside the trace).
    out, reaped = jax.jit(lambda x: call_and_reap(probed, tag="modules")(x, train=False))(X)
    want_out, want = hand_train_scan_eval(model, X)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(reaped["blocks"], want, **TOL)
    assert_same_state(model, twin)  # evaluation changed nothing
    v = jnp.full((T, D), 0.5)
    got = plant(probed, tag="modules")(
        {"blocks": lambda old, i: jnp.where(i == 2, v, old)}, X, False
    )
    np.testing.assert_allclose(got, hand_train_scan_eval(model, X, {2: v})[0], **TOL)
    clean = reap(probed, tag="modules")(X, False)
    r = patching_sweep(probed, clean, (-X, False), jnp.sum, tag="modules", names=["blocks"])
    assert list(r.names) == [f"blocks[{i}]" for i in range(L)]
    for i in range(L):
        want = hand_train_scan_eval(model, -X, {i: clean["blocks"][i]})[0].sum()
        np.testing.assert_allclose(r.values[i] + r.baseline, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------
# Module inputs as sites (inputs=True).


def test_inputs_are_sites_named_path_in(transformer):
    model = instrument(transformer, inputs=True)
    rec = Recorder()
    hand_transformer(transformer, X, rec)
    reaped = reap(model, tag="modules")(X)
    assert set(reaped) == set(rec.values) | {name + ":in" for name in rec.values}
    np.testing.assert_allclose(reaped["blocks.0:in"], X, **TOL)
    np.testing.assert_allclose(reaped["blocks.1:in"], rec.values["blocks.0"], **TOL)
    np.testing.assert_allclose(reaped["head:in"], rec.values["blocks.1"], **TOL)
    np.testing.assert_allclose(reaped["blocks.0.attn.q_proj:in"], rec.values["blocks.0.ln"], **TOL)
    # Block 1's input is block 0's output and nothing else reads it.
    v = jnp.full((T, D), 0.3)
    want = hand_transformer(transformer, X, Recorder({"blocks.0": v}))
    np.testing.assert_allclose(plant(model, tag="modules")({"blocks.1:in": v}, X), want, **TOL)
    np.testing.assert_allclose(
        plant(model, tag="modules")({"head:in": v}, X), lin(transformer.head, v), **TOL
    )
    # `where` picks inputs like any other name; without inputs=True there are none.
    only = reap(instrument(transformer, inputs=True, names="*:in"), tag="modules")(X)
    assert set(only) == {name + ":in" for name in rec.values}
    assert not any(name.endswith(":in") for name in reap(instrument(transformer), tag="modules")(X))
    with pytest.raises(TypeError, match="`inputs` to be True or False"):
        instrument(transformer, inputs="yes")


def test_inputs_of_scanned_layers_and_linen(eqx_scan):
    model = instrument(eqx_scan, inputs=True)
    x = X[0]
    reaped = reap(model, tag="modules")(x)
    _, want = hand_eqx_scan(eqx_scan, x)
    assert reaped["layers:in"].shape == (L, D)  # one row per iteration
    np.testing.assert_allclose(
        reaped["layers:in"], jnp.concatenate([x[None], want["layers"][:-1]]), **TOL
    )
    np.testing.assert_allclose(reaped["layers.mlp:in"], want["layers.ln"], **TOL)
    v = jnp.full(D, 0.5)
    got = plant(model, tag="modules")({"layers:in": lambda old, i: jnp.where(i == 1, v, old)}, x)
    np.testing.assert_allclose(got, hand_eqx_scan(eqx_scan, x, {0: v})[0], **TOL)
    # A Python flag among the arguments is not part of the input.
    train_model = TrainScan(nnx.Rngs(0, dropout=1))
    assert reap(instrument(train_model, inputs=True), tag="modules")(X, False)[
        "blocks:in"
    ].shape == (L, T, D)
    # Linen, through its interceptor.
    module = LinenModel()
    variables = module.init(jax.random.key(8), X)
    f = instrument(lambda x: module.apply(variables, x), inputs=True)
    rec = Recorder()
    hand_linen(variables["params"], X, rec)
    reaped = reap(f, tag="modules")(X)
    np.testing.assert_allclose(reaped["head:in"], rec.values["blocks_1"], **TOL)
    want = hand_linen(variables["params"], X, Recorder({"blocks_0": jnp.ones((T, D))}))
    np.testing.assert_allclose(
        plant(f, tag="modules")({"blocks_1:in": jnp.ones((T, D))}, X), want, **TOL
    )


class _Branching(eqx.Module):
    """An Equinox model whose forward branches on a traced value (an error under a trace)."""

    linear: eqx.nn.Linear

    def __call__(self, x):
        y = self.linear(x)
        return y if y.sum() > 0 else -y


def test_equinox_jit_of_a_transformed_model_does_not_warn_and_errors_name_the_model():
    """`eqx.filter_jit(reap(instrument(m)))` printed Equinox's "JAX-transformed callable"
    warning (the transformed function's `__wrapped__` was the model, a pytree of arrays);
    JAX's errors still name the model's own `__call__`, and the signature is the model's."""
    import inspect
    import warnings

    model = instrument(eqx.nn.MLP(2, 1, 3, 1, key=jax.random.key(0)))
    x = jnp.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reaped = eqx.filter_jit(reap(model, tag="modules"))(x)
        planted = eqx.filter_jit(plant(model, tag="modules"))({"layers.1": jnp.zeros(1)}, x)
    np.testing.assert_allclose(reaped["layers.1"], model(x), rtol=1e-6)
    np.testing.assert_allclose(planted, jnp.zeros(1))
    assert inspect.signature(reap(model, tag="modules")) == inspect.signature(model.target)
    branching = instrument(_Branching(eqx.nn.Linear(2, 2, key=jax.random.key(1))))
    line = inspect.getsourcelines(_Branching.__call__)[1]
    at = re.escape(f"__call__ at {__file__}:{line}")
    with pytest.raises(jax.errors.TracerBoolConversionError, match=at):
        reap(reap(branching, tag="modules"))(x)  # nested: the inner one's wrapper is unwrapped
