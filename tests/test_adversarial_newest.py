"""Adversarial checks of the newest code, as a user meets it: each case once gave
silently stale numbers, checked here against the function run by hand.

What a harvested function reads that is not an argument -- a closed-over config,
a module-level dict, the object of a bound method -- follows one rule
(docs/semantics.md): which object each name refers to is read at every call, so
a value rebound is seen, as calling the function would see it; the contents of a
mutable object are read when the function is traced, as under ``jax.jit``, and
the check mode names a call they would have changed.
"""

import dataclasses
import enum
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest
from harvest import call_and_reap, instrument, plant, reap, sow

X = jnp.arange(1.0, 4.0)  # no zero: a change at any position shows


def test_a_closed_over_config_mutated_is_read_when_traced(check_stale):
    config = {"scale": 2.0, "shift": (1.0, "add")}

    def f(x):
        y = x * config["scale"]
        return sow(y + config["shift"][0] if config["shift"][1] == "add" else y, name="y")

    reaped = reap(f)
    np.testing.assert_array_equal(reaped(X)["y"][0], X * 2.0 + 1.0)
    config["scale"] = 3.0  # the dict's contents: read when f is traced
    with pytest.raises(harvest.StaleValueError, match=r"config\['scale'\]: 2.0 -> 3.0"):
        reaped(X)
    harvest.clear_caches()
    np.testing.assert_array_equal(reaped(X)["y"][0], f(X))
    config = {"scale": 3.0, "shift": (0.0, "none")}  # the name rebound: seen at once
    np.testing.assert_array_equal(reaped(X)["y"][0], X * 3.0)


def test_a_list_the_function_appends_to_is_not_a_key():
    # A list is keyed by identity (see `_free_variables.static_key`): a log of traces.
    traces = []

    def f(x):
        traces.append(x.shape)
        return sow(x * 2.0, name="y", mode="strict")

    reaped = reap(f)
    for _ in range(3):
        np.testing.assert_array_equal(reaped(X)["y"], X * 2.0)
    assert traces == [(3,)]


SETTINGS = {"scale": 2.0}


def _scaled_by_module_dict(x):
    return sow(x * SETTINGS["scale"], name="y", mode="strict")


def test_a_module_level_dict_mutated_is_named_by_the_check_mode(check_stale):
    reaped, planted = reap(_scaled_by_module_dict), plant(_scaled_by_module_dict)
    try:
        np.testing.assert_array_equal(reaped(X)["y"], X * 2.0)
        np.testing.assert_array_equal(planted({}, X), X * 2.0)
        SETTINGS["scale"] = 5.0
        for run in (lambda: reaped(X), lambda: planted({}, X)):
            with pytest.raises(harvest.StaleValueError, match=r"SETTINGS\['scale'\]: 2.0 -> 5.0"):
                run()
        harvest.clear_caches()
        np.testing.assert_array_equal(reaped(X)["y"], X * 5.0)
        np.testing.assert_array_equal(planted({}, X), _scaled_by_module_dict(X))
    finally:
        SETTINGS["scale"] = 2.0


class _Layer:
    """A plain Python object holding a weight, as a hand-written model does."""

    def __init__(self, w):
        self.w = w

    def __call__(self, x):
        return jnp.sin(sow(x * self.w, name="y", mode="strict"))

    def apply(self, x):
        return self(x)


@pytest.mark.parametrize("bound", ["method", "object"])
def test_a_weight_attribute_rebound_between_calls_is_read_again(bound):
    layer = _Layer(jnp.array([1.0, 2.0, 3.0]))
    reaped = reap(layer.apply if bound == "method" else layer)
    np.testing.assert_array_equal(reaped(X)["y"], X * layer.w)
    for w in (jnp.array([3.0, 3.0, 3.0]), np.array([0.5, 4.0, 1.0], np.float32)):
        layer.w = w
        np.testing.assert_array_equal(reaped(X)["y"], X * w)


def test_an_argument_object_mutated_is_read_when_traced(check_stale):
    # A non-array argument is static, compared by `==` (an object: its identity), as
    # `jax.jit` compares a static argument: its attributes are read when f is traced.
    class Config:
        def __init__(self):
            self.scales = {"y": 2.0}

    config = Config()

    def f(x, config):
        return sow(x * config.scales["y"], name="y", mode="strict")

    reaped = reap(f)
    np.testing.assert_array_equal(reaped(X, config)["y"], X * 2.0)
    config.scales["y"] = 3.0
    with pytest.raises(harvest.StaleValueError, match=r"config.scales\['y'\]: 2.0 -> 3.0"):
        reaped(X, config)
    np.testing.assert_array_equal(reaped(X, Config())["y"], X * 2.0)  # another object


def test_instrumented_bound_method_sees_its_objects_rebound_weight():
    # `instrument(..., ops=True)` of a method: its eager calls go through one cached jit.
    layer = _Layer(jnp.array([1.0, 2.0, 3.0]))
    reaped = reap(instrument(layer.apply, ops=True), tag="modules")
    site = next(name for name in reaped(X) if name.startswith("sin"))
    np.testing.assert_allclose(reaped(X)[site], jnp.sin(X * layer.w))
    layer.w = jnp.array([3.0, 3.0, 3.0])
    np.testing.assert_allclose(reaped(X)[site], jnp.sin(X * layer.w))


def test_instrumented_function_with_its_closed_over_config_mutated(check_stale):
    config = {"scale": 2.0}

    def g(x):
        return jnp.sin(x * config["scale"])

    reaped = reap(instrument(g, ops=True), tag="modules")
    site = next(name for name in reaped(X) if name.startswith("sin"))
    np.testing.assert_allclose(reaped(X)[site], g(X))
    config["scale"] = 3.0
    with pytest.raises(harvest.StaleValueError, match="is stale"):
        reaped(X)
    harvest.clear_caches()
    np.testing.assert_allclose(reaped(X)[site], jnp.sin(X * 3.0))


MASK = np.array([1.0, 1.0, 1.0], np.float32)  # small: keyed by its bytes
TABLE = np.ones(2000, np.float32)  # large: traced


def _masked(x):
    return sow(x * MASK + TABLE[: x.shape[0]], name="y", mode="strict")


def _masked_sin(x):
    return jnp.sin(x * MASK + TABLE[: x.shape[0]])


def test_module_level_numpy_arrays_changed_in_place_are_read_again():
    # (Only the harvested function's own code is looked at: a function it calls
    # reads its module's values as they were when traced, as under ``jax.jit``.)
    reaped = reap(_masked)
    sited = reap(instrument(_masked_sin, ops=True), tag="modules")
    site = next(name for name in sited(X) if name.startswith("sin"))
    try:
        for mask, table in (([0.0, 2.0, 5.0], 3.0), ([4.0, 4.0, -1.0], -2.0)):
            MASK[:], TABLE[:] = mask, table
            want = X * MASK + TABLE[:3]
            np.testing.assert_array_equal(reaped(X)["y"], want)
            np.testing.assert_allclose(sited(X)[site], jnp.sin(want))
    finally:
        MASK[:], TABLE[:] = 1.0, 1.0


def test_a_numpy_weight_attribute_changed_in_place(check_stale):
    # An attribute of a plain method's object: which array it is, read at every call;
    # a NumPy array's contents changed in place, read when the method is traced.
    layer = _Layer(np.array([1.0, 2.0, 3.0], np.float32))
    reaped = reap(layer.apply)
    np.testing.assert_array_equal(reaped(X)["y"], X * layer.w)
    layer.w[:] = [-1.0, 0.5, 8.0]
    with pytest.raises(harvest.StaleValueError, match=r"self.w: a NumPy array"):
        reaped(X)
    layer.w = layer.w.copy()  # rebound: seen
    np.testing.assert_array_equal(reaped(X)["y"], X * layer.w)


def test_mutable_defaults_changed_between_calls(check_stale):
    config, weight = {"scale": 2.0}, np.array([1.0, 2.0, 3.0], np.float32)

    def f(x, config=config, *, weight=weight):
        return sow(x * config["scale"] * weight, name="y", mode="strict")

    reaped = reap(f)
    np.testing.assert_array_equal(reaped(X)["y"], f(X))
    config["scale"], weight[:] = 3.0, [4.0, -5.0, 6.0]
    with pytest.raises(harvest.StaleValueError, match="is stale"):
        reaped(X)
    harvest.clear_caches()
    np.testing.assert_array_equal(reaped(X)["y"], X * 3.0 * weight)


class _Mode(enum.Enum):
    DOUBLE = 2.0
    TRIPLE = 3.0


@dataclasses.dataclass(frozen=True)
class _Frozen:
    shift: float


class _Mutable:
    def __init__(self, shift):
        self.shift = shift


MODE, FROZEN, MUTABLE = _Mode.DOUBLE, _Frozen(1.0), _Mutable(0.5)


def _configured(x):
    return sow(x * MODE.value + FROZEN.shift + MUTABLE.shift, name="y", mode="strict")


def test_module_level_objects_rebound_or_mutated_between_calls_are_read_again():
    global MODE, FROZEN
    reaped = reap(_configured)
    try:
        np.testing.assert_array_equal(reaped(X)["y"], X * 2.0 + 1.5)
        MODE, FROZEN = _Mode.TRIPLE, _Frozen(-4.0)
        MUTABLE.shift = 2.0
        np.testing.assert_array_equal(reaped(X)["y"], _configured(X))
        np.testing.assert_array_equal(reaped(X)["y"], X * 3.0 - 2.0)
    finally:
        MODE, FROZEN, MUTABLE.shift = _Mode.DOUBLE, _Frozen(1.0), 0.5


class _Scaled(nn.Module):
    scale: float

    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="dense")(x) * self.scale


LINEN_MODEL = _Scaled(1.0)


def _apply_module_level_model(variables, x):
    return LINEN_MODEL.apply(variables, x)


def test_a_module_level_linen_model_rebound_between_calls_is_read_again():
    # The Linen pattern: `instrument` of a function applying a model defined at module level.
    global LINEN_MODEL
    x = jnp.ones((1, 3))
    variables = LINEN_MODEL.init(jax.random.key(0), x)
    run = call_and_reap(instrument(_apply_module_level_model), tag="modules")
    try:
        for scale in (1.0, 10.0):
            LINEN_MODEL = _Scaled(scale)
            out, reaps = run(variables, x)
            np.testing.assert_allclose(out, LINEN_MODEL.apply(variables, x), rtol=1e-6)
            np.testing.assert_allclose(reaps["dense"], out / scale, rtol=1e-6)
    finally:
        LINEN_MODEL = _Scaled(1.0)


def test_an_instrumented_partial_sees_its_numpy_argument_changed_in_place():
    weight = np.array([1.0, 2.0, 3.0], np.float32)

    def g(x, weight):
        return jnp.sin(x * weight)

    bound = functools.partial(g, weight=weight)
    reaped = reap(instrument(bound, ops=True), tag="modules")
    site = next(name for name in reaped(X) if name.startswith("sin"))
    weight[:] = [4.0, 5.0, -6.0]
    np.testing.assert_allclose(reaped(X)[site], bound(X))
    np.testing.assert_allclose(reaped(X)[site], jnp.sin(X * weight))
