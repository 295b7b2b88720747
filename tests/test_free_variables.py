"""The one rule for Python state (docs/semantics.md, "What harvest reads at each call,
and what when it traces"), case by case, on every path.

Where the rule reads a value at every call (which object a name refers to), the
harvested result equals the function run fresh. Where it reads a value when the
function is traced (the contents of a mutable object), the result equals
`jax.jit`'s (the same rule), the check mode raises `StaleValueError` naming the
value, and after `harvest.clear_caches()` the result equals the function run fresh.
"""

import collections
import dataclasses
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harvest
from harvest import attribution_patching, patching_sweep, plant, reap, sow

X = jnp.arange(1.0, 4.0)


def _read_when_traced(f, change, named):
    """Runs the contents case: ``change()`` mutates what ``f`` reads."""
    reaped, jitted = reap(f), jax.jit(f)
    harvest.config.update("check_stale", True)
    try:
        np.testing.assert_array_equal(reaped(X)["y"], jitted(X))
        change()
        with pytest.raises(harvest.StaleValueError, match=named):
            reaped(X)
    finally:
        harvest.config.update("check_stale", False)
    np.testing.assert_array_equal(reaped(X)["y"], jitted(X))  # as jax.jit: read at trace
    harvest.clear_caches()
    np.testing.assert_array_equal(reaped(X)["y"], f(X))


@dataclasses.dataclass
class _Scale:
    scale: float


MODULE_CFG = _Scale(2.0)


def _module_dataclass(x):
    return sow(x * MODULE_CFG.scale, name="y", mode="strict")


class _Holder:
    scale = 2.0

    def __init__(self):
        self.cfg = types.SimpleNamespace(inner=_Scale(2.0))
        self.table = np.ones(5000, np.float32)

    def nested(self, x):
        return sow(x * self.cfg.inner.scale, name="y", mode="strict")

    def tabled(self, x):
        return sow(x * self.table[:3], name="y", mode="strict")


MOD = types.ModuleType("harvest_test_mod")
MOD.X = 2.0
SCALE = 2.0


def _helper(x):
    return x * SCALE


def _calls_helper(x):
    return sow(_helper(x), name="y", mode="strict")


def _module_attribute(x):
    return sow(x * MOD.X, name="y", mode="strict")


def _class_attribute(x):
    return sow(x * _Holder.scale, name="y", mode="strict")


def _contents_cases():
    cfg = _Scale(2.0)
    ns = types.SimpleNamespace(scale=2.0)
    od = collections.OrderedDict(scale=2.0)
    dd = collections.defaultdict(float, scale=2.0)
    modes = {"double"}
    lst = [2.0]
    dl = {"scales": [2.0]}
    big = {i: 1.0 for i in range(2000)}
    a = types.SimpleNamespace(b=types.SimpleNamespace(c=_Scale(2.0)))
    holder = _Holder()

    def set_(obj, key, value):
        return lambda: obj.__setitem__(key, value)

    return {
        "dataclass": (
            lambda x: sow(x * cfg.scale, name="y", mode="strict"),
            lambda: setattr(cfg, "scale", 3.0),
            r"cfg.scale: 2.0 -> 3.0 \(read in",
        ),
        "module dataclass": (
            _module_dataclass,
            lambda: setattr(MODULE_CFG, "scale", 3.0),
            r"MODULE_CFG.scale: 2.0 -> 3.0",
        ),
        "SimpleNamespace": (
            lambda x: sow(x * ns.scale, name="y", mode="strict"),
            lambda: setattr(ns, "scale", 3.0),
            r"ns.scale: 2.0 -> 3.0",
        ),
        "OrderedDict": (
            lambda x: sow(x * od["scale"], name="y", mode="strict"),
            set_(od, "scale", 3.0),
            r"od\['scale'\]: 2.0 -> 3.0",
        ),
        "defaultdict": (
            lambda x: sow(x * dd["scale"], name="y", mode="strict"),
            set_(dd, "scale", 3.0),
            r"dd\['scale'\]: 2.0 -> 3.0",
        ),
        "set": (
            lambda x: sow(x * (2.0 if "double" in modes else 3.0), name="y", mode="strict"),
            lambda: (modes.clear(), modes.add("triple")),
            r"modes: \[\"'double'\"\] -> \[\"'triple'\"\]",
        ),
        "list": (
            lambda x: sow(x * lst[0], name="y", mode="strict"),
            set_(lst, 0, 3.0),
            r"lst\[0\]: 2.0 -> 3.0",
        ),
        "dict holding a list": (
            lambda x: sow(x * dl["scales"][0], name="y", mode="strict"),
            set_(dl["scales"], 0, 3.0),
            r"dl\['scales'\]\[0\]: 2.0 -> 3.0",
        ),
        "dict of 2000 items": (
            lambda x: sow(x * big[7], name="y", mode="strict"),
            set_(big, 7, 3.0),
            r"big\[7\]: 1.0 -> 3.0",
        ),
        "a.b.c.scale": (
            lambda x: sow(x * a.b.c.scale, name="y", mode="strict"),
            lambda: setattr(a.b.c, "scale", 3.0),
            r"a.b.c.scale: 2.0 -> 3.0",
        ),
        "self.cfg.inner.scale": (
            holder.nested,
            lambda: setattr(holder.cfg.inner, "scale", 3.0),
            r"self.cfg.inner.scale: 2.0 -> 3.0",
        ),
        "module attribute": (
            _module_attribute,
            lambda: setattr(MOD, "X", 3.0),
            r"MOD.X: 2.0 -> 3.0",
        ),
        "class attribute": (
            _class_attribute,
            lambda: setattr(_Holder, "scale", 3.0),
            r"_Holder.scale: 2.0 -> 3.0",
        ),
        "helper's global": (
            _calls_helper,
            lambda: globals().__setitem__("SCALE", 3.0),
            r"_helper's global SCALE: 2.0 -> 3.0",
        ),
        "large NumPy attribute in place": (
            holder.tabled,
            lambda: holder.table.__setitem__(slice(None), 3.0),
            r"self.table: a NumPy array of shape \(5000,\)",
        ),
    }


@pytest.mark.parametrize("case", sorted(_contents_cases()))
def test_contents_are_read_when_traced_and_named_by_the_check_mode(case):
    f, change, named = _contents_cases()[case]
    try:
        _read_when_traced(f, change, named)
    finally:
        global SCALE
        SCALE, MOD.X, _Holder.scale, MODULE_CFG.scale = 2.0, 2.0, 2.0, 2.0


def test_the_closure_of_a_function_f_calls():
    def make():
        s = 2.0

        def helper(x):
            return x * s

        def set_s(v):
            nonlocal s
            s = v

        return helper, set_s

    helper, set_s = make()
    _read_when_traced(
        lambda x: sow(helper(x), name="y", mode="strict"),
        lambda: set_s(3.0),
        r"helper's s: 2.0 -> 3.0",
    )


def _other_helper(x):
    return x * 5.0


HELPER = _helper


def _calls_rebound(x):
    return sow(HELPER(x), name="y", mode="strict")


LAMBDA_SCALE = 2.0


def _global_in_nested_code(x):
    scaled = (lambda v: v * LAMBDA_SCALE)(x)
    return sow(scaled + sum(LAMBDA_SCALE for _ in range(2)), name="y", mode="strict")


def test_what_each_name_refers_to_is_read_at_every_call(check_stale):
    global HELPER, LAMBDA_SCALE
    reaped, nested = reap(_calls_rebound), reap(_global_in_nested_code)
    try:
        np.testing.assert_array_equal(reaped(X)["y"], X * 2.0)
        HELPER = _other_helper  # a rebound global helper
        np.testing.assert_array_equal(reaped(X)["y"], _calls_rebound(X))
        np.testing.assert_array_equal(nested(X)["y"], _global_in_nested_code(X))
        LAMBDA_SCALE = 7.0  # read in a lambda and a generator expression inside f
        np.testing.assert_array_equal(nested(X)["y"], _global_in_nested_code(X))
    finally:
        HELPER, LAMBDA_SCALE = _helper, 2.0


def test_floats_are_keyed_by_repr():
    for s in (0.0, -0.0, float("nan"), 0.0):
        f = lambda x, s=s: sow(x * 0.0 + jnp.copysign(1.0, s) + s, name="y", mode="strict")  # noqa: E731
        np.testing.assert_array_equal(reap(f)(X)["y"], f(X))


def test_a_counter_f_updates_does_not_retrace():
    stats, traces = {"calls": 0}, []

    def f(x):
        traces.append(1)
        stats["calls"] += 1  # read and written when traced, as under jax.jit
        return sow(x * 2.0, name="y", mode="strict")

    reaped = reap(f)
    for _ in range(5):
        np.testing.assert_array_equal(reaped(X)["y"], X * 2.0)
    assert len(traces) == 1 and stats["calls"] == 1


@pytest.mark.parametrize("sweep", [patching_sweep, attribution_patching])
def test_the_sweeps_read_contents_when_traced_and_check_mode_names_them(sweep, check_stale):
    cfg = _Scale(2.0)

    def f(x):
        return (sow(x, name="h", mode="strict") * cfg.scale).sum()

    x, corrupt = jnp.array([1.0, 2.0, 4.0]), jnp.zeros(3)
    clean = reap(f)(x)
    metric = lambda y: y  # noqa: E731  (one metric for every sweep: its code is in the key)

    def fresh():
        """The sweep's answer from ``f`` itself, with cfg as it is now: h is x, so
        patching h at j is running f on the corrupted input with x[j] put in, and
        attributing is f's gradient at the corrupted input times (clean - corrupted)."""
        if sweep is patching_sweep:
            return [[f(corrupt.at[j].set(x[j])) - f(corrupt) for j in range(3)]]
        return [jax.grad(f)(corrupt) * (x - corrupt)]

    np.testing.assert_allclose(sweep(f, clean, (corrupt,), metric, axis=0).values, fresh())
    cfg.scale = 3.0  # a field of a closed-over dataclass: read when the program was traced
    with pytest.raises(harvest.StaleValueError, match=r"cfg\.scale: 2\.0 -> 3\.0"):
        sweep(f, clean, (corrupt,), metric, axis=0)
    harvest.clear_caches()
    np.testing.assert_allclose(sweep(f, clean, (corrupt,), metric, axis=0).values, fresh())
    np.testing.assert_allclose(fresh(), [x * 3.0])  # the reference itself moved with cfg


def test_plant_and_an_instrumented_module_in_check_mode(check_stale):
    nnx = pytest.importorskip("flax.nnx")
    cfg = {"scale": 2.0}

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3))

        def __call__(self, x):
            return sow(x * self.w * cfg["scale"], name="y", mode="strict")

    model = Model()
    planted = plant(lambda x: model(x) + 1.0)
    instrumented = reap(harvest.instrument(model, ops=True), tag="modules")
    np.testing.assert_allclose(planted({}, X), X * 2.0 + 1.0)
    instrumented(X)
    cfg["scale"] = 3.0
    with pytest.raises(harvest.StaleValueError, match="is stale"):
        planted({}, X)
    with pytest.raises(harvest.StaleValueError, match="is stale"):
        instrumented(X)
    harvest.clear_caches()
    np.testing.assert_allclose(planted({}, X), X * 3.0 + 1.0)


@pytest.mark.parametrize("container", ["dict", "list", "tuple"])
def test_a_closure_over_a_container_of_one_array(container):
    # Issue 36: one array in a dict, list or tuple a function or a plant closes over.
    d = jnp.array([1.0, -1.0, 2.0])
    held = {"dict": {"d": d}, "list": [d], "tuple": (d,)}[container]
    one = (lambda h: h["d"]) if container == "dict" else (lambda h: h[0])

    def f(x):
        return (sow(x * one(held), name="h", mode="strict") ** 2).sum()

    x, corrupt = jnp.ones(3), jnp.zeros(3)
    clean = reap(f)(x)
    np.testing.assert_allclose(
        patching_sweep(f, clean, (corrupt,), lambda y: y, axis=0).values, [np.asarray(d) ** 2]
    )
    np.testing.assert_allclose(
        attribution_patching(f, clean, (corrupt,), lambda y: y, axis=0).values, [np.zeros(3)]
    )
    np.testing.assert_allclose(
        plant(f)({"h": lambda old: old + one(held)}, x), ((2 * np.asarray(d)) ** 2).sum()
    )


def test_the_environment_variable_turns_the_check_mode_on():
    code = (
        "import harvest; print(harvest.config.check_stale)\n"
        "harvest.config.update('check_stale', False); print(harvest.config.check_stale)"
    )
    env = {**os.environ, "HARVEST_CHECK_STALE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "False"]


def test_bad_config_updates():
    with pytest.raises(ValueError, match="no such setting"):
        harvest.config.update("check_stal", True)
    with pytest.raises(TypeError, match="expected True or False"):
        harvest.config.update("check_stale", 1)


def test_clear_caches_reaches_the_instrumented_dispatch():
    # An instrumented module's eager calls run through `_eager_dispatch`'s programs,
    # kept in the one compile table: clear_caches drops them as it drops the others.
    nnx = pytest.importorskip("flax.nnx")
    cfg = {"scale": 2.0}

    class Model(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.lin(x) * cfg["scale"]

    model = Model()
    reaped = harvest.call_and_reap(harvest.instrument(model), tag="modules")
    out, acts = reaped(X)
    np.testing.assert_allclose(out, model(X), rtol=1e-6)
    np.testing.assert_allclose(acts["lin"], model.lin(X), rtol=1e-6)
    assert any(key[0] == "module" for key in harvest._compile_cache._table)  # the dispatch's
    cfg["scale"] = 3.0  # read when the program was traced, as jax.jit(model) would
    np.testing.assert_allclose(reaped(X)[0], model.lin(X) * 2.0, rtol=1e-6)
    harvest.clear_caches()
    np.testing.assert_allclose(reaped(X)[0], model(X), rtol=1e-6)


def test_ppl_reads_contents_when_traced_and_check_mode_names_them(check_stale):
    pytest.importorskip("tensorflow_probability", reason="harvest.ppl needs the ppl extra (TFP)")
    import tensorflow_probability.substrates.jax as tfp

    from harvest import ppl

    prior = _Scale(0.0)  # its `scale` is the prior's mean here

    def model(key):
        return ppl.random_variable(tfp.distributions.Normal(prior.scale, 1.0), name="z")(key)

    def normal_log_density(z, mean):  # by hand
        return -0.5 * np.log(2 * np.pi) - 0.5 * (z - mean) ** 2

    density = ppl.joint_log_prob(model)
    np.testing.assert_allclose(density({"z": 0.5}), normal_log_density(0.5, 0.0), rtol=1e-6)
    prior.scale = 1.0
    with pytest.raises(harvest.StaleValueError, match=r"prior\.scale: 0\.0 -> 1\.0") as error:
        density({"z": 0.5})
    assert "program for test_ppl_reads" in str(error.value)  # names the model, not ppl's wrapper
    harvest.clear_caches()
    np.testing.assert_allclose(density({"z": 0.5}), normal_log_density(0.5, 1.0), rtol=1e-6)
