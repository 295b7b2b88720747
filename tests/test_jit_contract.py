"""The calling contract is `jax.jit(f)`'s (docs/semantics.md, "What an eager call reads").

Each case runs one call sequence twice, side by side on the same Python state:
through harvest (``call_and_reap(f)``, a sweep, an instrumented model) and through
``jax.jit`` of the same function threaded by hand to return the sown value. After
every step the two agree -- both the output and the sown value -- whatever the
step changed (a closure rebound, a dict mutated, a static argument equal to the
last); side effects while tracing land where ``jax.jit`` puts them. Models passed
as arguments are read at every call, as ``nnx.jit`` and ``eqx.filter_jit`` read them.
"""

import dataclasses
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest
from harvest import call_and_reap, instrument, patching_sweep, plant, reap, sow

X = jnp.array([0.5, -1.0, 2.0], jnp.float32)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def side_by_side(f, hand, steps, static_argnums=()):
    """Runs ``steps`` -- ``(change, args)`` pairs -- calling ``call_and_reap(f)`` and
    ``jax.jit(hand)`` (``hand(*args) -> (out, h)``) after each change; they must agree."""
    harvested = call_and_reap(f)
    jitted = jax.jit(hand, static_argnums=static_argnums)
    for change, args in steps:
        change()
        out, reaped = harvested(*args)
        want_out, want_h = jitted(*args)
        close(out, want_out)
        close(reaped["h"], want_h)


def nothing():
    pass


def test_a_rebound_closed_over_array_is_read_when_traced():
    w = jnp.ones(3)

    def f(x):
        return sow(x * w, name="h", mode="strict").sum()

    def hand(x):
        return (x * w).sum(), x * w

    def rebind():
        nonlocal w
        w = jnp.full(3, 5.0)

    side_by_side(f, hand, [(nothing, (X,)), (rebind, (X,)), (nothing, (X * 2,))])


def test_a_closed_over_dict_mutated_and_a_global_rebound_are_read_when_traced():
    config = {"scale": 2.0}

    def f(x):
        return sow(x * config["scale"] * _GLOBAL[0], name="h", mode="strict")

    def hand(x):
        h = x * config["scale"] * _GLOBAL[0]
        return h, h

    def mutate():
        config["scale"] = 7.0

    def rebind():
        _GLOBAL[0] = 3.0

    try:
        side_by_side(f, hand, [(nothing, (X,)), (mutate, (X,)), (rebind, (X,))])
    finally:
        _GLOBAL[0] = 1.0


_GLOBAL = [1.0]


@dataclasses.dataclass(frozen=True)
class Cfg:
    scale: float


@pytest.mark.parametrize("first,second", [(Cfg(0.0), Cfg(-0.0)), (Cfg(2), Cfg(2.0))])
def test_a_frozen_dataclass_is_a_static_argument_keyed_as_jit_keys_it(first, second):
    def f(x, cfg):
        return sow(jnp.copysign(1.0, cfg.scale) * x * cfg.scale, name="h", mode="strict")

    def hand(x, cfg):
        h = jnp.copysign(1.0, cfg.scale) * x * cfg.scale
        return h, h

    side_by_side(f, hand, [(nothing, (X, first)), (nothing, (X, second))], static_argnums=1)


def test_a_python_float_is_keyed_by_its_bits():
    """A top-level float is a static argument told apart by its bits: -0.0 after 0.0
    gives what f gives fresh (jax.jit would give 0.0's program again)."""
    f = lambda x, s: sow(x * jnp.copysign(1.0, s), name="h", mode="strict")  # noqa: E731
    r = reap(f)
    close(r(X, 0.0)["h"], X)
    close(r(X, -0.0)["h"], -X)


class Slotted:
    __slots__ = ("scale",)

    def __init__(self, scale):
        self.scale = scale


class Hashed:
    def __init__(self, scale):
        self.scale = scale

    def __eq__(self, other):
        return isinstance(other, Hashed)

    def __hash__(self):
        return 0


@pytest.mark.parametrize("kind", [Slotted, Hashed])
def test_an_argument_object_is_static_and_its_attributes_read_when_traced(kind):
    obj = kind(2.0)

    def f(x, o):
        return sow(x * o.scale, name="h", mode="strict")

    def hand(x, o):
        return x * o.scale, x * o.scale

    def mutate():
        obj.scale = 9.0

    side_by_side(
        f,
        hand,
        [(nothing, (X, obj)), (mutate, (X, obj)), (nothing, (X, kind(4.0)))],
        static_argnums=1,
    )


def test_a_changed_default_and_class_attribute_are_read_when_traced():
    class Model:
        factor = 2.0

        def __call__(self, x, shift=1.0):
            return sow(x * self.factor + shift, name="h", mode="strict")

    model = Model()

    def hand(x):
        h = x * Model.factor + Model.__call__.__defaults__[0]
        return h, h

    def change():
        Model.factor = 5.0
        Model.__call__.__defaults__ = (3.0,)

    side_by_side(model, hand, [(nothing, (X,)), (change, (X,))])


def test_a_bound_method_of_a_plain_object_reads_its_attributes_when_traced():
    class Layer:
        def __init__(self):
            self.w = jnp.ones(3)

        def forward(self, x):
            return sow(x * self.w, name="h", mode="strict")

    layer = Layer()

    def hand(x):
        return x * layer.w, x * layer.w

    def rebind():
        layer.w = jnp.full(3, 4.0)

    side_by_side(layer.forward, hand, [(nothing, (X,)), (rebind, (X,))])


def test_side_effects_while_tracing_land_where_jit_puts_them():
    """A nonlocal counter, a global one and a debug callback's list: the user's own,
    as after the same calls of jax.jit(f), never a copy's."""
    harvested, jitted = [0, []], [0, []]

    def make(record):
        log = record[1]

        def f(x):
            global _TRACES
            _TRACES += 1
            record[0] += 1
            jax.debug.callback(lambda v: log.append(float(v)), x.sum())
            return sow(x * 2.0, name="h", mode="strict")

        return f

    global _TRACES
    _TRACES = 0
    r = reap(make(harvested))
    for _ in range(3):
        r(X)
    jax.effects_barrier()
    harvest_traces = _TRACES
    _TRACES = 0
    j = jax.jit(make(jitted))
    for _ in range(3):
        j(X)
    jax.effects_barrier()
    assert harvested[0] == jitted[0] == 1
    assert harvest_traces == _TRACES == 1
    assert harvested[1] == jitted[1] == [float(X.sum())] * 3


_TRACES = 0


def test_a_nonlocal_written_while_tracing_reaches_the_users_cell():
    count = 0

    def f(x):
        nonlocal count
        count += 1
        return sow(x, name="h", mode="strict")

    for _ in range(2):
        reap(f)(X)
    assert count == 1  # traced once, into the user's cell (jax.jit(f) leaves 1 too)


def test_a_fresh_lambda_plant_does_not_retrace_and_reads_its_closed_over_array():
    traces = []

    def f(x):
        traces.append(1)
        return sow(x * 2.0, name="h", mode="strict") + 1.0

    for scale in (1.0, 2.0, 3.0):
        s = jnp.asarray(scale)
        close(plant(f)({"h": lambda h: h * s}, X), X * 2.0 * scale + 1.0)
    assert len(traces) == 1


def test_clear_caches_reads_the_state_again():
    config = {"scale": 2.0}

    def f(x):
        return sow(x * config["scale"], name="h", mode="strict")

    r = reap(f)
    close(r(X)["h"], X * 2.0)
    config["scale"] = 3.0
    close(r(X)["h"], X * 2.0)  # read when traced, as jax.jit(f) reads it
    harvest.clear_caches()
    close(r(X)["h"], X * 3.0)


def test_the_wrapper_goes_with_its_function():
    def f(x):
        return sow(x, name="h", mode="strict")

    reap(f)(X)
    ref = weakref.ref(f)
    del f
    gc.collect()
    assert ref() is None


def test_a_sweep_reads_what_jit_reads():
    """A closed-over weight rebound between sweeps is read when traced: the second
    sweep equals the first (as jax.jit(f) would), and after clear_caches the new one."""
    w = jnp.array([1.0, 2.0, 3.0])

    def f(x):
        return (sow(x, name="h", mode="strict") * w).sum()

    clean, corrupt = {"h": jnp.ones(3)}, (jnp.zeros(3),)

    def sweep():  # patching h at position i from 0 to 1 adds w[i]
        return patching_sweep(f, clean, corrupt, lambda o: o, axis=0).values

    close(sweep(), w[None])
    w = jnp.array([5.0, 5.0, 5.0])
    close(sweep(), jnp.array([[1.0, 2.0, 3.0]]))
    harvest.clear_caches()
    close(sweep(), w[None])


def test_an_instrumented_function_reads_its_closure_when_traced():
    captured = {"s": 2.0}
    target = instrument(lambda x: jnp.tanh(x * captured["s"]), ops=True)

    def hand(x):
        return jnp.tanh(x * captured["s"])

    def rebind():
        captured["s"] = 5.0

    harvested = call_and_reap(target, tag="modules")
    jitted = jax.jit(hand)
    for change in (nothing, rebind):
        change()
        out, reaped = harvested(X)
        close(out, jitted(X))
        close(jax.tree_util.tree_leaves(reaped)[-1], jitted(X))


def test_model_state_passed_as_an_argument_is_read_at_every_call():
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    linear = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

    def nnx_f(m, x):
        return sow(m(x), name="h", mode="strict")

    by_nnx = nnx.jit(lambda m, x: m(x))
    close(reap(nnx_f)(linear, X)["h"], by_nnx(linear, X))
    linear.kernel[...] = linear.kernel[...] * -3.0  # trained in place
    close(reap(nnx_f)(linear, X)["h"], by_nnx(linear, X))

    mlp = eqx.nn.Linear(3, 3, key=jax.random.key(1))

    def eqx_f(m, x):
        return sow(m(x), name="h", mode="strict")

    by_eqx = eqx.filter_jit(lambda m, x: m(x))
    close(reap(eqx_f)(mlp, X)["h"], by_eqx(mlp, X))
    mlp = eqx.tree_at(lambda m: m.weight, mlp, mlp.weight * 2.0)
    close(reap(eqx_f)(mlp, X)["h"], by_eqx(mlp, X))


def test_bad_config_updates():
    with pytest.raises(ValueError, match="no such setting"):
        harvest.config.update("check_stale", True)
    with pytest.raises(TypeError, match="positive int"):
        harvest.config.update("warn_after", 0)
    assert harvest.config.warn_after == 32


@pytest.mark.parametrize("sweep", ["patching_sweep", "attribution_patching"])
def test_a_jax_jit_wrapped_function_sweeps_as_the_unwrapped_one(sweep):
    """Issue 44 item 5: a `jax.jit`-wrapped function is its own function (no Python
    `__call__` to unwrap), keyed as jit keys it; it sweeps as the plain one."""
    run = getattr(harvest, sweep)

    def f(x):
        return (sow(x * 2.0, name="h", mode="strict") * jnp.array([1.0, 2.0, 3.0])).sum()

    clean = reap(f)(X)
    want = run(f, clean, (jnp.zeros(3),), lambda o: o, axis=0).values
    close(want, [[1.0, -4.0, 12.0]])  # patching h_i adds 2 * x_i * (i + 1)
    for _ in range(2):
        close(run(jax.jit(f), clean, (jnp.zeros(3),), lambda o: o, axis=0).values, want)
