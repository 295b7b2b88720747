"""Nothing traced twice: a repeated sweep finds its sites without tracing, and an
eager call of an unchanged NNX module does not split its graph again; results
stay right after weights change in place, shapes change or the structure does."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import (
    attribution_patching,
    call_and_reap,
    patching_sweep,
    plant,
    reap,
    sow,
)
from harvest._calling import _nnx_state
from harvest._tools import _site_discovery
from harvest._walk import _leaves

nnx = pytest.importorskip("flax.nnx")


@pytest.fixture
def traces(monkeypatch):
    """How many times the sweeps traced a model to find its sites (none found yet)."""
    monkeypatch.setattr(_site_discovery, "_found", type(_site_discovery._found)())
    count = [0]
    real = _site_discovery.make_jaxpr

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_site_discovery, "make_jaxpr", counted)
    return count


def metric(out):
    return jnp.sum(out[:, -1])


def hand_forward(w1, w2, x, patch=None):
    """The model below, threaded by hand: `patch=(site, value)` replaces that site."""
    sites = {}
    h = jnp.tanh(x @ w1)
    sites["a"] = h = patch[1] if patch and patch[0] == "a" else h
    g = h + jnp.tanh(h @ w2)
    sites["b"] = g = patch[1] if patch and patch[0] == "b" else g
    return g.sum(-1), sites


def hand_sweep(w1, w2, x_clean, x_corrupt):
    """patching_sweep's values (whole sites) by hand: one patched run per site."""
    _, clean = hand_forward(w1, w2, x_clean)
    base = metric(hand_forward(w1, w2, x_corrupt)[0])
    return np.array(
        [metric(hand_forward(w1, w2, x_corrupt, (n, clean[n]))[0]) - base for n in ("a", "b")]
    )


def hand_attribution(w1, w2, x_clean, x_corrupt):
    """attribution_patching's values by hand: (clean - corrupt) . d metric / d site."""
    _, clean = hand_forward(w1, w2, x_clean)
    _, corrupt = hand_forward(w1, w2, x_corrupt)

    def from_site(name, value):
        return metric(hand_forward(w1, w2, x_corrupt, (name, value))[0])

    return np.array(
        [
            jnp.sum((clean[n] - corrupt[n]) * jax.grad(from_site, 1)(n, corrupt[n]))
            for n in ("a", "b")
        ]
    )


class Net(nnx.Module):
    def __init__(self, width=4, seed=0):
        k1, k2 = jax.random.split(jax.random.key(seed))
        self.w1 = nnx.Param(jax.random.normal(k1, (3, width)))
        self.w2 = nnx.Param(jax.random.normal(k2, (width, width)) / width)

    def __call__(self, x):
        h = sow(jnp.tanh(x @ self.w1[...]), name="a", mode="strict")
        g = sow(h + jnp.tanh(h @ self.w2[...]), name="b", mode="strict")
        return g.sum(-1)


def data(batch=2, positions=3, seed=1):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (batch, positions, 3)), jax.random.normal(
        k2, (batch, positions, 3)
    )


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sweep", [patching_sweep, attribution_patching])
def test_a_repeated_sweep_does_not_trace_and_sees_weights_changed_in_place(traces, sweep):
    hand = hand_sweep if sweep is patching_sweep else hand_attribution
    model = Net()
    x_clean, x_corrupt = data()
    clean = reap(model)(x_clean)
    close(
        sweep(model, clean, (x_corrupt,), metric).values,
        hand(model.w1[...], model.w2[...], x_clean, x_corrupt),
    )
    first = traces[0]
    assert first == 1
    model.w2[...] = model.w2[...] * 3.0  # trained in place: the same sites, new values
    clean = reap(model)(x_clean)
    again = sweep(model, clean, (x_corrupt * 0.5,), metric).values
    assert traces[0] == first
    close(again, hand(model.w1[...], model.w2[...], x_clean, x_corrupt * 0.5))


def test_a_new_shape_or_structure_finds_the_sites_again(traces):
    model = Net()
    x_clean, x_corrupt = data()
    patching_sweep(model, reap(model)(x_clean), (x_corrupt,), metric)
    assert traces[0] == 1
    x_clean, x_corrupt = data(batch=3, positions=5)  # new shapes: new sites
    values = patching_sweep(model, reap(model)(x_clean), (x_corrupt,), metric).values
    assert traces[0] == 2
    close(values, hand_sweep(model.w1[...], model.w2[...], x_clean, x_corrupt))
    model.w2 = nnx.Param(jnp.eye(4) * 0.5)  # a weight replaced: same structure, same sites
    patching_sweep(model, reap(model)(x_clean), (x_corrupt,), metric)
    wide = Net(width=6, seed=2)  # another module of other shapes
    values = patching_sweep(wide, reap(wide)(x_clean), (x_corrupt,), metric).values
    close(values, hand_sweep(wide.w1[...], wide.w2[...], x_clean, x_corrupt))
    assert traces[0] == 3


# ---------------------------------------------------------------------------
# Eager NNX calls.


class Counted(nnx.Module):
    """Counts its calls in a variable, and doubles its output when `double` is set."""

    def __init__(self):
        self.net = Net()
        self.calls = nnx.BatchStat(jnp.zeros(()))
        self.double = False

    def __call__(self, x):
        self.calls[...] = self.calls[...] + 1.0
        out = self.net(x)
        return 2.0 * out if self.double else out


def test_an_eager_call_after_the_first_does_not_split_the_graph():
    model = Counted()
    x = data()[0]
    capture = reap(model)
    capture(x)
    walks = _nnx_state._split_cache.walks
    for _ in range(3):
        reaped = capture(x)
    assert _nnx_state._split_cache.walks == walks
    close(reaped["b"], hand_forward(model.net.w1[...], model.net.w2[...], x)[1]["b"])
    assert float(model.calls[...]) == 4.0  # the state the calls changed, written back each time


def test_an_eager_call_sees_weights_flags_and_layers_changed():
    model = Counted()
    x = data()[0]
    capture = reap(model)
    capture(x)
    model.net.w1[...] = model.net.w1[...] * -1.0  # in place: no new split needed
    walks = _nnx_state._split_cache.walks
    close(capture(x)["a"], jnp.tanh(x @ model.net.w1[...]))
    assert _nnx_state._split_cache.walks == walks
    model.double = True  # a static flag: the structure changed
    close(reap(model)(x)["b"], hand_forward(model.net.w1[...], model.net.w2[...], x)[1]["b"])
    doubled, _ = call_and_reap(model)(x)
    close(doubled, 2.0 * hand_forward(model.net.w1[...], model.net.w2[...], x)[0])
    assert _nnx_state._split_cache.walks > walks
    model.net = Net(width=6, seed=3)  # a layer replaced
    close(capture(x)["a"], jnp.tanh(x @ model.net.w1[...]))
    model.extra = nnx.Param(jnp.ones(2))  # an attribute added
    before = _nnx_state._split_cache.walks
    close(capture(x)["b"], hand_forward(model.net.w1[...], model.net.w2[...], x)[1]["b"])
    assert _nnx_state._split_cache.walks == before + 1
    assert float(model.calls[...]) == 6.0  # every call counted, none twice


def test_a_list_of_layers_changed_in_place_is_seen():
    class Stack(nnx.Module):
        def __init__(self):
            self.layers = nnx.List([nnx.Linear(3, 3, rngs=nnx.Rngs(i)) for i in range(2)])

        def __call__(self, x):
            for i, layer in enumerate(self.layers):
                x = sow(layer(x), name=f"l{i}", mode="strict")
            return x

    model = Stack()
    x = jnp.ones((2, 3))
    assert sorted(reap(model)(x)) == ["l0", "l1"]
    model.layers.append(nnx.Linear(3, 3, rngs=nnx.Rngs(5)))
    reaped = reap(model)(x)
    assert sorted(reaped) == ["l0", "l1", "l2"]
    close(reaped["l2"], model.layers[2](model.layers[1](model.layers[0](x))))
    model.layers[0] = nnx.Linear(3, 3, rngs=nnx.Rngs(9))
    close(reap(model)(x)["l0"], model.layers[0](x))


def test_the_caches_do_not_keep_a_module_alive():
    model = Net()
    x_clean, x_corrupt = data()
    clean = reap(model)(x_clean)
    patching_sweep(model, clean, (x_corrupt,), metric)
    reap(model)(x_clean)
    gone = weakref.ref(model)
    kept = len(_nnx_state._split_cache.splits)
    del model
    gc.collect()
    assert gone() is None
    assert len(_nnx_state._split_cache.splits) < kept


def test_jax_clear_caches_forgets_the_sites(traces):
    model = Net()
    x_clean, x_corrupt = data()
    clean = reap(model)(x_clean)
    patching_sweep(model, clean, (x_corrupt,), metric)
    jax.clear_caches()
    patching_sweep(model, clean, (x_corrupt,), metric)
    assert traces[0] == 2


# ---------------------------------------------------------------------------
# Sweeps of modules that change their own state: every run measured from the
# state the module had, none of it written back.


class Scaled(Net):
    """Counts its calls; its output scales with the count, so a run that saw
    another run's count would be off."""

    def __init__(self):
        super().__init__()
        self.calls = nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x):
        self.calls[...] = self.calls[...] + 1.0
        return super().__call__(x) * self.calls[...]


@pytest.mark.parametrize("sweep", [patching_sweep, attribution_patching])
def test_a_sweep_of_a_module_counting_its_calls_leaves_the_count(sweep):
    hand = hand_sweep if sweep is patching_sweep else hand_attribution
    model = Scaled()
    x_clean, x_corrupt = data()
    clean = reap(model)(x_clean)  # a call: the count is 1 now
    values = sweep(model, clean, (x_corrupt,), metric).values
    assert float(model.calls[...]) == 1.0
    close(values, 2.0 * hand(model.w1[...], model.w2[...], x_clean, x_corrupt))


class Normed(nnx.Module):
    """A BatchNorm in training mode: batch statistics used, running averages updated."""

    def __init__(self):
        self.lin = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(4, momentum=0.5, rngs=nnx.Rngs(0))

    def __call__(self, x):
        h = sow(self.lin(x), name="h", mode="strict")
        return sow(jnp.tanh(self.bn(h)), name="n", mode="strict").sum(-1)


def normed_by_hand(model, x, deltas=None, patch=None):
    """`Normed` threaded by hand; `deltas` are added to the sites, `patch=(site, position, value)`
    puts `value` at that position."""
    deltas = deltas or {}

    def site(name, value):
        if patch and patch[0] == name:
            value = value.at[:, patch[1]].set(patch[2][:, patch[1]])
        return value + deltas.get(name, 0.0)

    h = site("h", x @ model.lin.kernel[...] + model.lin.bias[...])
    mean, var = h.mean((0, 1)), h.var((0, 1))
    normed = (h - mean) / jnp.sqrt(var + model.bn.epsilon) * model.bn.scale[...]
    n = site("n", jnp.tanh(normed + model.bn.bias[...]))
    return n.sum(-1), {"h": h, "n": n}


@pytest.mark.parametrize("sweep", [patching_sweep, attribution_patching])
def test_a_sweep_of_a_batchnorm_in_training_mode_matches_runs_by_hand(sweep):
    model = Normed()
    x_clean, x_corrupt = data()
    clean = reap(model)(x_clean)
    running = (model.bn.mean[...], model.bn.var[...])
    assert float(jnp.abs(running[0]).sum()) > 0  # the reap updated them, as a call would
    values = sweep(model, clean, (x_corrupt,), metric, axis=1).values
    close(model.bn.mean[...], running[0])
    close(model.bn.var[...], running[1])
    _, cl = normed_by_hand(model, x_clean)
    out, co = normed_by_hand(model, x_corrupt)
    base = metric(out)
    if sweep is patching_sweep:
        hand = [
            [
                metric(normed_by_hand(model, x_corrupt, patch=(n, p, cl[n]))[0]) - base
                for p in range(3)
            ]
            for n in ("h", "n")
        ]
    else:
        grads = jax.grad(lambda d: metric(normed_by_hand(model, x_corrupt, deltas=d)[0]))(
            {n: jnp.zeros_like(co[n]) for n in ("h", "n")}
        )
        hand = [((cl[n] - co[n]) * grads[n]).sum((0, 2)) for n in ("h", "n")]
    close(values, np.array(hand))


# ---------------------------------------------------------------------------
# Models of one structure share a program; a sweep checks a model's structure once per call.


class Traced(Net):
    """Net counting how many times it is traced (its body runs only then)."""

    runs = 0

    def __call__(self, x):
        Traced.runs += 1
        return super().__call__(x)


def test_a_second_model_of_the_same_structure_shares_the_program_and_reads_its_own_weights():
    first, second = Traced(seed=0), Traced(seed=5)  # equal graph definitions, other weights
    x = data()[0]
    Traced.runs = 0
    close(reap(first)(x)["b"], hand_forward(first.w1[...], first.w2[...], x)[1]["b"])
    for _ in range(2):
        reaped = reap(second)(x)
        close(reaped["b"], hand_forward(second.w1[...], second.w2[...], x)[1]["b"])
    assert Traced.runs == 1  # one trace served both models
    # The second split hands back the first's graph definition, so keys compare by identity.
    assert _nnx_state.split_nodes(second)[1].graphdef is _nnx_state.split_nodes(first)[1].graphdef


def test_a_sweep_checks_the_structure_once_per_call_and_sees_a_layer_replaced(monkeypatch):
    model = Net()
    x_clean, x_corrupt = data()
    patching_sweep(model, reap(model)(x_clean), (x_corrupt,), metric)
    checks = [0]
    real = _nnx_state._Split.now

    def counted(self, nodes):
        checks[0] += 1
        return real(self, nodes)

    monkeypatch.setattr(_nnx_state._Split, "now", counted)
    clean = reap(model)(x_clean)
    checks[0] = 0
    patching_sweep(model, clean, (x_corrupt,), metric)
    assert checks[0] == 1  # finding the sites and running the program share one check
    model.w2 = nnx.Param(jnp.eye(4) * 0.5)  # a layer replaced between two calls: seen
    values = patching_sweep(model, reap(model)(x_clean), (x_corrupt,), metric).values
    close(values, hand_sweep(model.w1[...], model.w2[...], x_clean, x_corrupt))


def test_planted_values_of_other_types_are_still_cast_and_checked():
    # Site.check passes a value of the site's shape and dtype as is; any other is cast or refused.
    def f(x):
        return sow(x * 2.0, name="h", mode="strict") + 1.0

    x = jnp.ones(3, jnp.float32)
    want = np.full(3, 4.0, np.float32)
    for value in (jnp.full(3, 3.0), np.full(3, 3.0, np.float32), np.full(3, 3.0, np.float64)):
        got = plant(f)({"h": value}, x)
        assert got.dtype == jnp.float32
        close(got, want)
    total = lambda x: sow(x.sum(), name="s", mode="strict") * 2.0  # noqa: E731
    for number in (3.0, 3):  # a Python number takes the site's dtype
        got = plant(total)({"s": number}, x)
        assert got.dtype == jnp.float32 and float(got) == 6.0
    with pytest.raises(ValueError, match="int32"):
        plant(f)({"h": jnp.full(3, 3, jnp.int32)}, x)
    with pytest.raises(ValueError, match=r"\[4\]"):
        plant(f)({"h": jnp.full(4, 3.0)}, x)


class WithNumber(nnx.Module):
    """A Python number in its state (not an array): the call's leaves are keyed the slow way."""

    runs = 0

    def __init__(self):
        self.net = Net()
        self.scale = nnx.Variable(2.0)

    def __call__(self, x):
        WithNumber.runs += 1
        return self.net(x) * self.scale.get_value()


def test_a_number_in_the_state_is_data_and_is_read_at_every_call():
    model, (x_clean, x_corrupt) = WithNumber(), data()
    WithNumber.runs = 0
    out, reaped = call_and_reap(model)(x_clean)
    want, sites = hand_forward(model.net.w1[...], model.net.w2[...], x_clean)
    close(out, 2.0 * want)
    close(reaped["b"], sites["b"])
    model.scale.set_value(5.0)  # a number changed in place: traced, so no new trace
    close(call_and_reap(model)(x_clean)[0], 5.0 * want)
    assert WithNumber.runs == 1
    clean = reap(model)(x_clean)
    for scale in (5.0, 7.0):  # the sweep's program reads the number as the walk does: traced
        model.scale.set_value(scale)
        values = patching_sweep(model, clean, (x_corrupt,), metric).values
        if scale == 5.0:
            runs = WithNumber.runs
        scaled = lambda out: scale * metric(out)  # noqa: E731  the metric sees the scaled output
        base = scaled(hand_forward(model.net.w1[...], model.net.w2[...], x_corrupt)[0])
        by_hand = [
            scaled(hand_forward(model.net.w1[...], model.net.w2[...], x_corrupt, (n, sites[n]))[0])
            - base
            for n in ("a", "b")
        ]
        close(values, by_hand)
    assert WithNumber.runs == runs


def test_static_outputs_come_back_as_themselves_whichever_came_first():
    def f(x, label):
        h = sow(x * 2.0, name="h", mode="strict")
        return (label, h) if label else h

    x = jnp.ones(2)
    assert reap(f)(x, "")["h"].shape == (2,)
    for label in ("first", "second", "first"):
        out, reaped = call_and_reap(f)(x, label)
        assert out[0] == label and isinstance(out[0], str)
        close(out[1], reaped["h"])
    close(call_and_reap(f)(x, "")[0], 2.0 * x)


def test_a_type_is_told_a_graph_node_after_new_node_types_are_registered():
    class Plain:
        pass

    assert not _leaves.is_graph_node(Plain())

    class Later(nnx.Module):  # registered as a graph node type on definition
        pass

    assert _leaves.is_graph_node(Later()) and not _leaves.is_graph_node(Plain())


# -- what an eager call's compile-cache key must see between calls --


def forward(model, x, scale=1.0):
    return model(x) * scale


def test_models_and_python_values_given_to_one_harvested_function_are_each_seen():
    first, second = Net(seed=0), Net(seed=5)  # same structure, other weights
    x = data()[0]
    capture = call_and_reap(forward)

    def by_hand(model, scale=1.0):
        out, sites = hand_forward(model.w1[...], model.w2[...], x)
        return out * scale, sites["b"]

    for model, kwargs in [
        (first, {}),
        (second, {}),  # another model: its own weights
        (second, {}),
        (second, {"scale": 3.0}),  # a static keyword: another key
        (first, {"scale": 3.0}),
        (first, {"scale": -0.0}),
    ]:
        out, reaped = capture(model, x, **kwargs)
        want_out, want_b = by_hand(model, kwargs.get("scale", 1.0))
        close(out, want_out)
        close(reaped["b"], want_b)
        assert np.signbit(np.asarray(out)).tolist() == np.signbit(np.asarray(want_out)).tolist()


def test_the_same_model_twice_or_two_models_are_told_apart():
    def two(a, b, x):
        return sow(a(x), tag="outer", name="a_out", mode="strict") + sow(
            b(x), tag="outer", name="b_out", mode="strict"
        )

    m1, m2 = Net(seed=0), Net(seed=5)
    x = data()[0]
    capture = reap(two, tag="outer")
    for a, b in [(m1, m2), (m1, m1), (m2, m1), (m1, m1)]:
        reaped = capture(a, b, x)
        close(reaped["a_out"], hand_forward(a.w1[...], a.w2[...], x)[0])
        close(reaped["b_out"], hand_forward(b.w1[...], b.w2[...], x)[0])


class Grown(nnx.Module):
    """A model whose structure the tests below change between calls of one capture."""

    def __init__(self):
        self.first = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
        self.steps = 0  # a static number, not state

    def __call__(self, x):
        x = sow(self.first(x), name="first", mode="strict")
        if hasattr(self, "second"):
            x = sow(self.second(x), name="second", mode="strict")
        if isinstance(self.steps, nnx.Variable):
            x = x + self.steps[...]
        return x


def test_structural_changes_through_nnx_between_calls_of_one_capture_are_seen():
    model = Grown()
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    capture = call_and_reap(model)
    capture(x)
    capture(x)
    model.second = nnx.Linear(3, 3, rngs=nnx.Rngs(1))  # a submodule added
    out, reaped = capture(x)
    assert sorted(reaped) == ["first", "second"]
    close(out, model.second(model.first(x)))
    model.second.kernel = nnx.Param(jnp.eye(3) * 2.0)  # a variable replaced
    close(capture(x)[0], 2.0 * model.first(x) + model.second.bias[...])
    other = Grown()
    other.second = nnx.Linear(3, 3, rngs=nnx.Rngs(4))
    nnx.update(model, nnx.state(other))  # another state of the same structure
    close(capture(x)[0], other.second(other.first(x)))
    model.steps = nnx.data(nnx.Variable(jnp.zeros(())))  # a static number replaced by a variable
    close(capture(x)[0], other.second(other.first(x)))
    model.steps[...] = jnp.ones(())  # ...whose value is then read
    close(capture(x)[0], other.second(other.first(x)) + 1.0)
    del model.second  # an attribute deleted
    out, reaped = capture(x)
    assert sorted(reaped) == ["first"]
    close(out, other.first(x) + 1.0)
    object.__setattr__(model, "second", nnx.Linear(3, 3, rngs=nnx.Rngs(7)))  # past NNX's setattr
    out, reaped = capture(x)
    assert sorted(reaped) == ["first", "second"]
