"""Eager calls of an instrumented NNX module through its one `jax.jit` (`_calling`):
after the first call no graph split and no trace, yet every change a user can make
through NNX between calls is seen (the module is an argument, split as `nnx.jit`
splits it), and the state the call changes is written back as a direct call leaves
it; each result against the module called directly."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest import call_and_reap, harvest, instrument, nest, plant, reap
from harvest._calling import _nnx_state

nnx = pytest.importorskip("flax.nnx")

X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


class Grown(nnx.Module):
    """A model whose structure the tests change between calls of one capture."""

    traces = 0  # Python runs only while tracing

    def __init__(self, seed=0):
        self.first = nnx.Linear(3, 3, rngs=nnx.Rngs(seed))
        self.layers = nnx.List([nnx.Linear(3, 3, rngs=nnx.Rngs(seed + 1))])
        self.steps = 0  # a static number, not state
        self.negate = False  # a static flag

    def __call__(self, x):
        Grown.traces += 1
        x = self.first(x)
        for layer in self.layers:
            x = layer(x)
        if hasattr(self, "second"):
            x = self.second(x)
        if isinstance(self.steps, nnx.Variable):
            x = x + self.steps[...]
        return -x if self.negate else x


def by_hand(model, x):
    """The module's sites and output, each submodule called directly."""
    sites = {"first": model.first(x)}
    h = sites["first"]
    for i, layer in enumerate(model.layers):
        h = sites[f"layers.{i}"] = layer(h)
    if hasattr(model, "second"):
        h = sites["second"] = model.second(h)
    if isinstance(model.steps, nnx.Variable):
        h = h + model.steps[...]
    return (-h if model.negate else h), sites


def check(capture, model, x=X):
    out, reaped = capture(x)
    want, sites = by_hand(model, x)
    close(out, want)
    assert list(reaped) == list(sites)
    for name, value in sites.items():
        close(reaped[name], value)


@pytest.mark.filterwarnings("ignore:'.value' setter is now deprecated")
def test_later_calls_neither_split_nor_trace():
    model = Grown()
    capture = call_and_reap(instrument(model), tag="modules")
    check(capture, model)
    walks, traces = _nnx_state._split_cache.walks, Grown.traces
    for _ in range(3):
        check(capture, model)
    assert (_nnx_state._split_cache.walks, Grown.traces) == (walks, traces)
    model.first.kernel[...] = -model.first.kernel[...]  # in place: read, not split again
    model.layers[0].bias.value = jnp.full(3, 0.5, jnp.float32)  # (a weak type would retrace)
    check(capture, model)
    assert (_nnx_state._split_cache.walks, Grown.traces) == (walks, traces)


def test_every_structural_change_through_nnx_is_seen():
    model = Grown()
    capture = call_and_reap(instrument(model), tag="modules")
    check(capture, model)
    model.negate = True  # a static flag: the same arrays, another program
    check(capture, model)
    model.negate = False  # back: the first program again
    check(capture, model)
    object.__setattr__(model.layers[0], "__class__", Shifted)  # another class, same attributes
    check(capture, model)
    model.second = nnx.Linear(3, 3, rngs=nnx.Rngs(2))  # a submodule added
    check(capture, model)
    model.second.kernel = nnx.Param(jnp.eye(3) * 2.0)  # a variable replaced
    check(capture, model)
    model.layers.append(nnx.Linear(3, 3, rngs=nnx.Rngs(3)))  # a list grown
    check(capture, model)
    model.layers[0] = nnx.Linear(3, 3, rngs=nnx.Rngs(4))  # a list item replaced
    check(capture, model)
    other = Grown(seed=7)
    other.second = nnx.Linear(3, 3, rngs=nnx.Rngs(8))
    other.layers.append(nnx.Linear(3, 3, rngs=nnx.Rngs(9)))
    nnx.update(model, nnx.state(other))  # another state of the same structure
    close(capture(X)[0], by_hand(other, X)[0])
    model.steps = nnx.data(nnx.Variable(jnp.ones(())))  # a static number replaced by a variable
    check(capture, model)
    model.steps[...] = jnp.full((), 3.0)
    check(capture, model)
    del model.second  # an attribute deleted
    check(capture, model)
    object.__setattr__(model, "second", nnx.Linear(3, 3, rngs=nnx.Rngs(5)))  # past NNX's setattr
    check(capture, model)
    vars(model.first)["bias"] = nnx.Param(jnp.full(3, -1.0))  # past any setattr
    check(capture, model)
    attributes = {**vars(model.first), "bias": nnx.Param(jnp.full(3, 2.0))}
    object.__setattr__(model.first, "__dict__", attributes)  # a whole new __dict__
    check(capture, model)


class Shifted(nnx.Linear):
    def __call__(self, x):
        return super().__call__(x) + 1.0


def test_a_second_model_of_one_structure_shares_the_program_and_reads_its_own_weights():
    first, second = Grown(seed=0), Grown(seed=5)
    check(call_and_reap(instrument(first), tag="modules"), first)
    traces = Grown.traces
    capture = call_and_reap(instrument(second), tag="modules")
    for _ in range(2):
        check(capture, second)
    assert Grown.traces == traces  # one program for both, as on harvest's own path
    for model in (first, second):  # a capture written afresh at each call
        check(call_and_reap(instrument(model), tag="modules"), model)
    assert Grown.traces == traces


class Tied(nnx.Module):
    """Two layers sharing one kernel variable."""

    def __init__(self):
        self.a = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
        self.b = nnx.Linear(3, 3, rngs=nnx.Rngs(1))
        self.b.kernel = self.a.kernel

    def __call__(self, x):
        return self.b(self.a(x))


def test_a_shared_variable_stays_shared_and_is_read_once_changed():
    model = Tied()
    capture = reap(instrument(model), tag="modules")
    for scale in (1.0, -2.0):
        model.a.kernel[...] = model.a.kernel[...] * scale  # seen by both layers
        reaped = capture(X)
        close(reaped["a"], model.a(X))
        close(reaped["b"], model.b(model.a(X)))
    model.b.kernel = nnx.Param(jnp.eye(3))  # untied
    reaped = capture(X)
    close(reaped["b"], model.b(model.a(X)))
    assert model.b.kernel is not model.a.kernel


class Stateful(nnx.Module):
    """Dropout (an RNG stream's counter), batch statistics and an NNX intermediate."""

    def __init__(self):
        self.linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        self.norm = nnx.BatchNorm(4, momentum=0.5, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))

    def __call__(self, x):
        h = self.norm(self.linear(x))
        self.sow(nnx.Intermediate, "normed", h)
        return self.drop(h)


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")
def test_the_state_a_call_changes_is_written_back_as_a_direct_call_leaves_it():
    model = Stateful()
    twin = nnx.clone(model)  # called directly, the reference
    capture = call_and_reap(instrument(model), tag="modules")
    for step in range(3):
        x = X + step
        out, reaped = capture(x)
        want = twin(x)
        close(out, want)  # the same dropout mask: the RNG counter advanced alike
        close(reaped["drop"], want)
        # each call sows its intermediate again on the state the last one left
        del model.normed, twin.normed
    for ours, theirs in zip(_leaves(model), _leaves(twin)):  # batch statistics, RNG counts
        close(ours, theirs)
    model(X), twin(X)  # an intermediate sown before the call stays, and the call sows after it
    out, _ = capture(X)
    close(out, twin(X))
    assert len(model.normed.get_value()) == 2
    close(model.normed.get_value()[-1], twin.normed.get_value()[-1])


def _leaves(model):
    return [
        jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf
        for leaf in jax.tree_util.tree_leaves(nnx.state(model))
    ]


def test_a_misspelt_name_is_a_short_error():
    model = Grown()

    def message(**kwargs):
        with pytest.raises(ValueError, match="'nope' matches no sow site") as error:
            reap(instrument(model, **kwargs), tag="modules", names="nope")(X)
        return str(error.value)

    assert len(message()) < 600 and "'nope'" in message(names="layers.*")


def test_plants_python_values_and_disable_jit():
    model = Grown()
    planted = plant(instrument(model), tag="modules")
    both = harvest(instrument(model), tag="modules")
    ones = jnp.ones((2, 3))
    for _ in range(2):
        close(planted({"first": ones}, X), model.layers[0](ones))
        out, reaped = both({"layers.0": ones}, X)
        close(out, ones)
        close(reaped["first"], model.first(X))
    close(planted({"first": lambda h: 2.0 * h}, X), model.layers[0](2.0 * model.first(X)))
    capture = call_and_reap(instrument(model), tag="modules")
    with jax.disable_jit():
        check(capture, model)
    check(capture, model)


class Scaled(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

    def __call__(self, x, scale=1.0, double=False):
        out = self.linear(x) * scale
        return 2.0 * out if double else out  # Python control flow on the flag


def test_python_numbers_among_the_arguments_stay_static():
    model = Scaled()
    capture = call_and_reap(instrument(model), tag="modules")
    for scale, double in [(1.0, False), (3.0, True), (-0.0, False)]:
        out, reaped = capture(X, scale, double=double)
        want = model.linear(X) * scale * (2.0 if double else 1.0)
        close(out, want)
        close(reaped["linear"], model.linear(X))
        assert np.signbit(np.asarray(out)).tolist() == np.signbit(np.asarray(want)).tolist()


def test_a_dropped_capture_does_not_keep_the_module_alive():
    model = Grown()
    capture = reap(instrument(model), tag="modules")
    for _ in range(2):
        capture(X)
    gone = weakref.ref(model)
    del model, capture
    gc.collect()
    assert gone() is None


class Scoped(nnx.Module):
    """A submodule called under a `nest` scope: its site's name is nested."""

    def __init__(self):
        self.inner = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
        self.outer = nnx.Linear(3, 3, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.outer(nest(self.inner, scope="block")(x))


def test_scoped_names_come_back_as_nested_dicts_in_program_order():
    model = Scoped()
    capture = reap(instrument(model), tag="modules")
    for _ in range(2):
        reaped = capture(X)
        assert list(reaped) == ["block", "outer"]
        close(reaped["block"]["inner"], model.inner(X))
        close(reaped["outer"], model.outer(model.inner(X)))
        # traced once (`nest` inside walks harvest's own way); the next call is the jit's
