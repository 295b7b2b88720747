"""Conformance scenarios for oryx-style harvest modules.

Every scenario is a small, deterministic function ``scenario(h, jax, jnp)``
that receives a harvest *module* ``h`` exposing oryx 0.2.9's public names
(``sow``, ``sow_cond``, ``harvest``, ``reap``, ``plant``, ``call_and_reap``,
``nest``, ``sow_p``) and returns a ``dict`` of cases.  Each case is a
zero-argument callable (run by :func:`run_all` under :func:`catch`) or a
ready value; its result is a pytree of concrete arrays / Python scalars
(dicts, tuples, lists, None), or a :class:`Raised` record when the case
raised (expected errors are recorded the same way as surprising ones).

This file must stay importable and runnable, unchanged, under two very
different environments:

* the reference venv (JAX 0.4.38 + the real ``oryx.core.interpreters.harvest``),
  used by ``record_golden.py`` to write ``golden/oryx_0.2.9.json``;
* the project venv (JAX 0.10.x + ``harvest.compat.oryx``), used by
  ``compare.py`` to check the drop-in module against that golden file.

So: no top-level import of jax, oryx or harvest here, only APIs that exist in
both JAX versions, and only the documented public surface of oryx's harvest.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "SCENARIOS",
    "Raised",
    "Scenario",
    "catch",
    "run_all",
    "scenario",
]


# --------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    doc: str
    fn: Callable[..., dict[str, Any]]


SCENARIOS: dict[str, Scenario] = {}


def scenario(fn):
    """Registers ``fn``; its name is the scenario name, its docstring's first
    line the one-line description."""
    name = fn.__name__
    if name in SCENARIOS:
        raise ValueError(f"duplicate scenario {name!r}")
    doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
    SCENARIOS[name] = Scenario(name, doc, fn)
    return fn


@dataclasses.dataclass(frozen=True)
class Raised:
    """An exception captured in place of a result.

    ``type_name`` is the exception class name, ``mro`` every class name in its
    MRO (so a subclass, e.g. ``HarvestError(ValueError)``, can be matched
    against a golden ``ValueError``), ``message`` the first line of the text,
    shortened.
    """

    type_name: str
    message: str
    mro: tuple = ()

    @classmethod
    def from_exception(cls, e: BaseException) -> Raised:
        text = str(e).strip().splitlines()
        msg = text[0] if text else ""
        if len(msg) > 160:
            msg = msg[:157] + "..."
        return cls(type(e).__name__, msg, tuple(c.__name__ for c in type(e).__mro__))


def catch(thunk: Callable[[], Any]) -> Any:
    """Runs ``thunk()``; returns its (materialised) value or a :class:`Raised`."""
    try:
        return _materialise(thunk())
    except Exception as e:  # noqa: BLE001 - recording is the point
        return Raised.from_exception(e)


def _materialise(tree):
    """Forces JAX arrays to host numpy so errors surface inside ``catch``."""
    if isinstance(tree, dict):
        return {k: _materialise(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_materialise(v) for v in tree)
    if isinstance(tree, list):
        return [_materialise(v) for v in tree]
    if tree is None or isinstance(tree, (bool, int, float, str, Raised)):
        return tree
    return np.asarray(tree)


_VERBOSE = False
LEAKS: list[str] = []  # "scenario.case" after which trace state had leaked


def trace_state_guard(jax) -> Callable[[], bool]:
    """Returns ``check()``: True (and resets) if JAX's trace state leaked.

    oryx 0.2.9 sets the current trace inside generator-based ``lu``
    transformations; when a traced function raises, that context is never
    exited and every later computation in the process runs under a dead
    HarvestTrace (typically ``UnexpectedTracerError``).  The runners call
    this after each case so one expected error cannot poison the next case.
    It touches ``jax._src.core`` (JAX-private) and degrades to a no-op if the
    layout differs.
    """
    try:
        from jax._src import core  # noqa: PLC0415 - JAX-private, best effort

        ctx = core.trace_ctx
        ctx.is_top_level  # noqa: B018
    except Exception:  # noqa: BLE001
        return lambda: False

    def check() -> bool:
        if ctx.is_top_level():
            return False
        ctx.reset()
        if hasattr(ctx, "update_thread_local_jit_state"):
            ctx.update_thread_local_jit_state()
        return True

    return check


def run_all(
    h,
    jax,
    jnp,
    names: list[str] | None = None,
    verbose: bool = False,
    isolate: bool = False,
    processes: int = 2,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Runs the selected (default: all) scenarios; returns {name: result}.

    ``isolate=False`` runs everything in this process, calling the trace-state
    guard after each case.  ``isolate=True`` runs every *case* in its own
    forked worker (JAX's backend must not be initialised in the parent yet;
    the parent never touches an array), so no error, leaked trace or
    polluted cache can affect another case.  The golden file is recorded this
    way because oryx 0.2.9 leaks trace state whenever a harvest raises.
    """
    global _VERBOSE, _CTX
    _VERBOSE = verbose
    del LEAKS[:]
    selected = list(names) if names else list(SCENARIOS)
    unknown = [n for n in selected if n not in SCENARIOS]
    if unknown:
        raise KeyError(f"unknown scenarios: {unknown}")
    _CTX = (h, jax, jnp)
    if not isolate:
        guard = trace_state_guard(jax)
        out = {}
        for n in selected:
            out[n], leaks = _run_in_process(SCENARIOS[n], h, jax, jnp, guard)
            LEAKS.extend(leaks)
        return out

    import multiprocessing  # noqa: PLC0415

    mp = multiprocessing.get_context("fork")
    with mp.Pool(processes, maxtasksperchild=1) as pool:
        listed = {n: pool.apply_async(_child_keys, (n,)) for n in selected}
        listed = {n: r.get(timeout) for n, r in listed.items()}
        jobs = {}
        for n, keys in listed.items():
            if isinstance(keys, Raised):
                continue
            for k in keys:
                jobs[(n, k)] = pool.apply_async(_child_case, (n, k))
        done = {nk: r.get(timeout) for nk, r in jobs.items()}
    out = {}
    for n, keys in listed.items():
        if isinstance(keys, Raised):
            out[n] = keys
            continue
        out[n] = {}
        for k in keys:
            value, leaked = done[(n, k)]
            out[n][k] = value
            if leaked:
                LEAKS.append(f"{n}.{k}")
    return out


_CTX: Any = None


def _run_in_process(sc: Scenario, h, jax, jnp, guard):
    leaks = []
    try:
        cases = sc.fn(h, jax, jnp)
        if not isinstance(cases, dict):
            raise TypeError(f"scenario {sc.name} returned {type(cases).__name__}")
    except Exception as e:  # noqa: BLE001
        if _VERBOSE:
            traceback.print_exc()
        if guard():
            leaks.append(sc.name)
        return Raised.from_exception(e), leaks
    result = {}
    for key, value in cases.items():
        result[key] = _run_case(sc.name, key, value)
        if guard():
            leaks.append(f"{sc.name}.{key}")
            if _VERBOSE:
                print(f"[{sc.name}.{key}] leaked JAX trace state (reset)")
    return result, leaks


def _run_case(name, key, value):
    if callable(value):
        value = catch(value)
        if _VERBOSE and isinstance(value, Raised):
            print(f"[{name}.{key}] {value.type_name}: {value.message}", flush=True)
    return _materialise(value)


def _child_keys(name):
    h, jax, jnp = _CTX
    try:
        return list(SCENARIOS[name].fn(h, jax, jnp))
    except Exception as e:  # noqa: BLE001
        return Raised.from_exception(e)


def _child_case(name, key):
    h, jax, jnp = _CTX
    guard = trace_state_guard(jax)
    cases = SCENARIOS[name].fn(h, jax, jnp)
    value = _run_case(name, key, cases[key])
    return value, guard()


def f32(jnp, x):
    return jnp.asarray(x, dtype=jnp.float32)


# --------------------------------------------------------------------------
# Basics: sow / reap / plant / harvest / call_and_reap
# --------------------------------------------------------------------------


def _two_sows(h):
    """y = x + 1 (sown 'y'), z = 2y (sown 'z'); returns z + 1."""

    def f(x):
        y = h.sow(x + 1.0, tag="t", name="y")
        z = h.sow(y * 2.0, tag="t", name="z")
        return z + 1.0

    return f


@scenario
def sow_identity_outside_harvest(h, jax, jnp):
    """sow/sow_cond act as identity when no harvest transformation is active."""
    x = f32(jnp, [1.0, 2.0])
    return {
        "sow": lambda: h.sow(x, tag="t", name="x"),
        "sow_clobber": lambda: h.sow(x, tag="t", name="x", mode="clobber"),
        "sow_key": lambda: h.sow(x, tag="t", name="x", key=f32(jnp, 3.0)),
        "sow_cond_true": lambda: h.sow_cond(x, jnp.array(True), tag="t", name="x"),
        "sow_cond_false": lambda: h.sow_cond(x, jnp.array(False), tag="t", name="x"),
        "jit": lambda: jax.jit(lambda v: h.sow(v * 2.0, tag="t", name="x"))(x),
        "python_scalar": lambda: h.sow(1.5, tag="t", name="s"),
    }


@scenario
def reap_basic(h, jax, jnp):
    """reap returns a dict of every strict sow of the tag, returned or not."""
    f = _two_sows(h)

    def g(x):  # sown value never returned
        h.sow(x * 3.0, tag="t", name="hidden")
        return x

    return {
        "reap": lambda: h.reap(f, tag="t")(f32(jnp, 1.0)),
        "reap_vector": lambda: h.reap(f, tag="t")(f32(jnp, [1.0, 2.0])),
        "unreturned": lambda: h.reap(g, tag="t")(f32(jnp, 2.0)),
        "other_tag": lambda: h.reap(f, tag="nope")(f32(jnp, 1.0)),
    }


@scenario
def plant_basic(h, jax, jnp):
    """plant(f)(plants, *args) substitutes planted values and returns f's output."""
    f = _two_sows(h)
    x = f32(jnp, 1.0)
    return {
        "plant_y": lambda: h.plant(f, tag="t")({"y": f32(jnp, 10.0)}, x),
        "plant_z": lambda: h.plant(f, tag="t")({"z": f32(jnp, 10.0)}, x),
        "plant_both": lambda: h.plant(f, tag="t")({"y": f32(jnp, 10.0), "z": f32(jnp, 0.0)}, x),
        "plant_none": lambda: h.plant(f, tag="t")({}, x),
        "plant_python_float": lambda: h.plant(f, tag="t")({"z": 4.0}, x),
        "plant_unknown_name": lambda: h.plant(f, tag="t")({"nope": f32(jnp, 5.0)}, x),
    }


@scenario
def harvest_plant_and_reap(h, jax, jnp):
    """harvest(f)(plants, *args) -> (out, reaps of the names not planted)."""
    f = _two_sows(h)
    x = f32(jnp, 1.0)
    hf = h.harvest(f, tag="t")
    return {
        "nothing_planted": lambda: hf({}, x),
        "plant_y": lambda: hf({"y": f32(jnp, 10.0)}, x),
        "plant_all": lambda: hf({"y": f32(jnp, 10.0), "z": f32(jnp, 1.0)}, x),
    }


@scenario
def call_and_reap_structure(h, jax, jnp):
    """call_and_reap returns (f's pytree output, reaps) and forwards kwargs."""

    def f(x, *, scale):
        a = h.sow(x * scale, tag="t", name="a")
        return (a, {"b": x + 1.0, "c": [a, x]})

    out, reaps = h.call_and_reap(f, tag="t")(f32(jnp, [1.0, 2.0]), scale=3.0)
    return {
        "out": lambda: out,
        "reaps": lambda: reaps,
        "reap_kwargs": lambda: h.reap(f, tag="t")(f32(jnp, 2.0), scale=f32(jnp, 0.5)),
        "plant_kwargs": lambda: h.plant(f, tag="t")({"a": f32(jnp, 9.0)}, f32(jnp, 2.0), scale=1.0),
    }


@scenario
def harvest_same_tag_twice(h, jax, jnp):
    """An outer harvest of the same tag finds nothing left to reap or plant."""
    f = _two_sows(h)
    x = f32(jnp, 1.0)
    inner = h.harvest(f, tag="t")
    outer = h.harvest(inner, tag="t")
    return {
        "outer": lambda: outer({}, {"y": f32(jnp, 5.0)}, x),
        "outer_plant_ignored": lambda: outer({"z": f32(jnp, 100.0)}, {}, x),
        "reap_of_reap": lambda: h.reap(h.reap(f, tag="t"), tag="t")(x),
    }


@scenario
def reap_plant_constant(h, jax, jnp):
    """Sows of values that do not depend on the inputs are reaped and planted."""

    def f(x):
        c = h.sow(jnp.ones(2, jnp.float32), tag="t", name="c")
        return x + c

    x = f32(jnp, [1.0, 2.0])
    return {
        "reap": lambda: h.reap(f, tag="t")(x),
        "plant": lambda: h.plant(f, tag="t")({"c": f32(jnp, [10.0, 20.0])}, x),
        "reap_jit": lambda: h.reap(jax.jit(f), tag="t")(x),
    }


# --------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------


@scenario
def strict_duplicate_errors(h, jax, jnp):
    """Two strict sows of one name: reap raises; plant raises only if planted."""

    def f(x):
        a = h.sow(x, tag="t", name="x")
        b = h.sow(a + 1.0, tag="t", name="x")
        return b

    x = f32(jnp, 1.0)
    return {
        "reap": lambda: h.reap(f, tag="t")(x),
        "plant_that_name": lambda: h.plant(f, tag="t")({"x": f32(jnp, 5.0)}, x),
        "plant_nothing": lambda: h.plant(f, tag="t")({}, x),
        "harvest": lambda: h.harvest(f, tag="t")({}, x),
    }


@scenario
def clobber_mode(h, jax, jnp):
    """clobber: reap keeps the last sown value; a plant replaces every sow."""

    def f(x):
        a = h.sow(x, tag="t", name="x", mode="clobber")
        b = h.sow(a + 1.0, tag="t", name="x", mode="clobber")
        return b * 2.0

    def mixed(x):
        a = h.sow(x, tag="t", name="x", mode="clobber")
        return h.sow(a + 1.0, tag="t", name="x", mode="strict")

    x = f32(jnp, 1.0)
    return {
        "reap": lambda: h.reap(f, tag="t")(x),
        "plant": lambda: h.plant(f, tag="t")({"x": f32(jnp, 10.0)}, x),
        "harvest": lambda: h.harvest(f, tag="t")({}, x),
        "clobber_then_strict": lambda: h.reap(mixed, tag="t")(x),
    }


@scenario
def append_mode_outside_loop(h, jax, jnp):
    """append outside a loop: one sow reaps its bare value; a second one raises."""

    def one(x):
        return h.sow(x * 2.0, tag="t", name="a", mode="append")

    def two(x):
        a = h.sow(x, tag="t", name="a", mode="append")
        return h.sow(a + 1.0, tag="t", name="a", mode="append")

    x = f32(jnp, [1.0, 2.0])
    return {
        "single_reap": lambda: h.reap(one, tag="t")(x),
        "single_plant": lambda: h.plant(one, tag="t")({"a": f32(jnp, [7.0, 8.0])}, x),
        "double_reap": lambda: h.reap(two, tag="t")(x),
        "double_plant": lambda: h.plant(two, tag="t")({"a": f32(jnp, [0.0, 0.0])}, x),
    }


@scenario
def sow_cond_outside_loop(h, jax, jnp):
    """sow_cond: reaped value is kept if pred else zeros; repeated sow_conds combine."""

    def f(x, p):
        return h.sow_cond(x * 2.0, p, tag="t", name="v") + 1.0

    def twice(x, p1, p2):
        a = h.sow_cond(x, p1, tag="t", name="v")
        b = h.sow_cond(a + 10.0, p2, tag="t", name="v")
        return b

    x = f32(jnp, [1.0, 2.0])
    T, F = jnp.array(True), jnp.array(False)
    return {
        "reap_true": lambda: h.call_and_reap(f, tag="t")(x, T),
        "reap_false": lambda: h.call_and_reap(f, tag="t")(x, F),
        "plant_true": lambda: h.plant(f, tag="t")({"v": f32(jnp, [5.0, 5.0])}, x, T),
        "plant_false": lambda: h.plant(f, tag="t")({"v": f32(jnp, [5.0, 5.0])}, x, F),
        "twice_TF": lambda: h.reap(twice, tag="t")(x, T, F),
        "twice_FT": lambda: h.reap(twice, tag="t")(x, F, T),
        "twice_FF": lambda: h.reap(twice, tag="t")(x, F, F),
        "twice_TT": lambda: h.reap(twice, tag="t")(x, T, T),
    }


@scenario
def mode_validation(h, jax, jnp):
    """Invalid modes: sow('cond_clobber'), sow_cond(mode!='cond_clobber'), unknown mode."""

    def bogus(x):
        return h.sow(x, tag="t", name="x", mode="bogus")

    x = f32(jnp, 1.0)
    return {
        "sow_cond_clobber_mode": lambda: catch(
            lambda: h.sow(x, tag="t", name="x", mode="cond_clobber")
        ),
        "sow_cond_with_clobber": lambda: catch(
            lambda: h.sow_cond(x, jnp.array(True), tag="t", name="x", mode="clobber")
        ),
        "bogus_outside_harvest": lambda: bogus(x),
        "bogus_reap": lambda: h.reap(bogus, tag="t")(x),
        "bogus_plant": lambda: h.plant(bogus, tag="t")({"x": f32(jnp, 2.0)}, x),
        "bogus_other_tag": lambda: h.reap(bogus, tag="other")(x),
    }


# --------------------------------------------------------------------------
# Tags, allow/blocklists, exclusive, nest, pytrees, key
# --------------------------------------------------------------------------


def _two_tags(h):
    def f(x):
        a = h.sow(x + 1.0, tag="a", name="v")
        b = h.sow(a * 2.0, tag="b", name="v")
        return b + 1.0

    return f


@scenario
def tag_isolation(h, jax, jnp):
    """Same name under two tags: reap one tag while planting the other."""
    f = _two_tags(h)
    x = f32(jnp, 1.0)
    reap_a_plant_b = h.reap(lambda pb, x: h.plant(f, tag="b")(pb, x), tag="a")
    plant_b_reap_a = h.call_and_reap(
        lambda x: h.plant(f, tag="b")({"v": f32(jnp, 100.0)}, x), tag="a"
    )
    return {
        "reap_a": lambda: h.reap(f, tag="a")(x),
        "reap_b": lambda: h.reap(f, tag="b")(x),
        "plant_a_reap_b": lambda: h.reap(
            lambda x: h.plant(f, tag="a")({"v": f32(jnp, 10.0)}, x), tag="b"
        )(x),
        "reap_a_over_plant_b": lambda: reap_a_plant_b({"v": f32(jnp, 100.0)}, x),
        "plant_b_reap_a": lambda: plant_b_reap_a(x),
        "harvest_a_then_b": lambda: h.harvest(
            lambda x: h.harvest(f, tag="a")({"v": f32(jnp, 3.0)}, x), tag="b"
        )({}, x),
    }


@scenario
def hashable_tags(h, jax, jnp):
    """Tags may be any hashable: tuples and ints act as distinct namespaces."""

    def f(x):
        a = h.sow(x, tag=("ns", 1), name="v")
        b = h.sow(a + 1.0, tag=7, name="v")
        return b

    x = f32(jnp, 2.0)
    return {
        "tuple_tag": lambda: h.reap(f, tag=("ns", 1))(x),
        "int_tag": lambda: h.reap(f, tag=7)(x),
        "plant_int": lambda: h.plant(f, tag=7)({"v": f32(jnp, 0.0)}, x),
        "string_7_is_other": lambda: h.reap(f, tag="7")(x),
    }


def _three_sows(h):
    def f(x):
        a = h.sow(x + 1.0, tag="t", name="a")
        b = h.sow(a * 2.0, tag="t", name="b")
        c = h.sow(b - 3.0, tag="t", name="c")
        return c

    return f


@scenario
def allowlist(h, jax, jnp):
    """allowlist restricts which names are reaped and which plants apply."""
    f = _three_sows(h)
    x = f32(jnp, 1.0)
    plants = {"a": f32(jnp, 10.0), "b": f32(jnp, 100.0)}
    return {
        "reap": lambda: h.reap(f, tag="t", allowlist=["a", "c"])(x),
        "reap_empty": lambda: h.reap(f, tag="t", allowlist=[])(x),
        "plant": lambda: h.plant(f, tag="t", allowlist=["b"])(plants, x),
        "harvest": lambda: h.harvest(f, tag="t", allowlist=("a", "b"))({"a": f32(jnp, 0.0)}, x),
        "call_and_reap": lambda: h.call_and_reap(f, tag="t", allowlist={"b"})(x),
    }


@scenario
def blocklist(h, jax, jnp):
    """blocklist hides names from reap and plant; it wins over allowlist."""
    f = _three_sows(h)
    x = f32(jnp, 1.0)
    plants = {"a": f32(jnp, 10.0), "b": f32(jnp, 100.0)}
    return {
        "reap": lambda: h.reap(f, tag="t", blocklist=["a"])(x),
        "plant": lambda: h.plant(f, tag="t", blocklist=["b"])(plants, x),
        "harvest": lambda: h.harvest(f, tag="t", blocklist=("c",))({"a": f32(jnp, 0.0)}, x),
        "both_lists": lambda: h.reap(f, tag="t", allowlist=["a", "b"], blocklist=["b"])(x),
    }


@scenario
def exclusive_mode(h, jax, jnp):
    """exclusive=True drops other tags' sows so an outer transformation sees none."""
    f = _two_tags(h)
    x = f32(jnp, 1.0)
    inner_incl = lambda x: h.call_and_reap(f, tag="a")(x)  # noqa: E731
    inner_excl = lambda x: h.call_and_reap(f, tag="a", exclusive=True)(x)  # noqa: E731
    return {
        "inclusive_outer_b": lambda: h.call_and_reap(inner_incl, tag="b")(x),
        "exclusive_outer_b": lambda: h.call_and_reap(inner_excl, tag="b")(x),
        "exclusive_plant_outer_b": lambda: h.reap(
            lambda x: h.plant(f, tag="a", exclusive=True)({}, x), tag="b"
        )(x),
        "exclusive_reap_own_tag": lambda: h.reap(f, tag="b", exclusive=True)(x),
    }


@scenario
def nest_scopes(h, jax, jnp):
    """nest(f, scope=s) nests f's reaps/plants under key s; scopes may repeat names."""

    def leaf(x):
        return h.sow(x * 2.0, tag="t", name="x")

    def f(x):
        a = h.nest(leaf, scope="first")(x)
        b = h.nest(leaf, scope="second")(a)
        return b

    def deep(x):
        return h.nest(h.nest(leaf, scope="inner"), scope="outer")(x)

    x = f32(jnp, 1.0)
    return {
        "harvest_nest": lambda: h.harvest(h.nest(leaf, scope="foo"), tag="t")({}, x),
        "plant_nest": lambda: h.harvest(h.nest(leaf, scope="foo"), tag="t")(
            {"foo": {"x": f32(jnp, 7.0)}}, x
        ),
        "two_scopes_reap": lambda: h.reap(f, tag="t")(x),
        "two_scopes_plant_one": lambda: h.plant(f, tag="t")({"first": {"x": f32(jnp, 5.0)}}, x),
        "deep_reap": lambda: h.reap(deep, tag="t")(x),
        "deep_plant": lambda: h.plant(deep, tag="t")({"outer": {"inner": {"x": f32(jnp, 3.0)}}}, x),
        "nest_outside_harvest": lambda: h.nest(leaf, scope="foo")(x),
        "nest_other_tag": lambda: h.reap(h.nest(leaf, scope="foo"), tag="other")(x),
    }


@scenario
def nest_with_jit(h, jax, jnp):
    """nest composes with jit on either side and with a clash against a plain sow."""

    def leaf(x):
        return h.sow(x + 1.0, tag="t", name="x")

    def clash(x):  # scope name equals a sibling sow name -> duplicate strict name
        y = h.nest(leaf, scope="x")(x)
        return h.sow(y, tag="t", name="x")

    x = f32(jnp, 1.0)
    return {
        "harvest_jit_nest": lambda: h.harvest(jax.jit(h.nest(leaf, scope="foo")), tag="t")({}, x),
        "harvest_nest_jit": lambda: h.harvest(h.nest(jax.jit(leaf), scope="foo"), tag="t")({}, x),
        "plant_jit_nest": lambda: h.plant(jax.jit(h.nest(leaf, scope="foo")), tag="t")(
            {"foo": {"x": f32(jnp, 4.0)}}, x
        ),
        "scope_clash": lambda: h.reap(clash, tag="t")(x),
    }


@scenario
def pytree_values(h, jax, jnp):
    """A sown pytree (dict/tuple) is reaped and planted as a whole pytree."""

    def f(x):
        tree = h.sow({"a": x, "b": (x * 2.0, x + 1.0)}, tag="t", name="tree")
        return tree["a"] + tree["b"][0] * tree["b"][1]

    x = f32(jnp, [1.0, 2.0])
    planted = {"a": f32(jnp, [0.0, 0.0]), "b": (f32(jnp, [1.0, 1.0]), f32(jnp, [3.0, 4.0]))}
    return {
        "reap": lambda: h.reap(f, tag="t")(x),
        "plant": lambda: h.plant(f, tag="t")({"tree": planted}, x),
        "harvest": lambda: h.harvest(f, tag="t")({}, x),
        "tuple_sow": lambda: h.reap(lambda x: h.sow((x, x * 3.0), tag="t", name="p")[1], tag="t")(
            x
        ),
    }


@scenario
def sow_with_key(h, jax, jnp):
    """key= adds a fake dependence only: values, reaps and plants are unchanged."""

    def f(x, k):
        y = h.sow(x + 1.0, tag="t", name="y", key=k)
        z = h.sow_cond(y * 2.0, jnp.array(True), tag="t", name="z", key=k)
        return z

    x, k = f32(jnp, 1.0), jnp.array([0, 42], dtype=jnp.uint32)
    return {
        "call": lambda: f(x, k),
        "reap": lambda: h.reap(f, tag="t")(x, k),
        "plant": lambda: h.plant(f, tag="t")({"y": f32(jnp, 10.0)}, x, k),
        "jit_reap": lambda: jax.jit(h.reap(f, tag="t"))(x, k),
    }


# --------------------------------------------------------------------------
# jit / vmap / grad
# --------------------------------------------------------------------------


@scenario
def jit_inside(h, jax, jnp):
    """Sows inside jit (returned, unreturned, closed-over) are reaped and planted."""

    def f(x):
        y = jax.jit(lambda v: h.sow(v * 2.0, tag="t", name="y"))(x)
        return y + 1.0

    def unreturned(x):
        @jax.jit
        def g(v):
            h.sow(v * 5.0, tag="t", name="hidden")
            return v

        return g(x)

    def closed(x):
        c = x * 3.0

        @jax.jit
        def g(v):
            return h.sow(v + c, tag="t", name="c")

        return g(x)

    x = f32(jnp, 1.0)
    return {
        "reap": lambda: h.call_and_reap(f, tag="t")(x),
        "plant": lambda: h.plant(f, tag="t")({"y": f32(jnp, 10.0)}, x),
        "unreturned": lambda: h.reap(unreturned, tag="t")(x),
        "closed_over_reap": lambda: h.reap(closed, tag="t")(x),
        "closed_over_plant": lambda: h.plant(closed, tag="t")({"c": f32(jnp, -1.0)}, x),
    }


@scenario
def jit_nested(h, jax, jnp):
    """jit inside jit inside the harvest, and jit around the harvested function."""

    def f(x):
        @jax.jit
        def outer(v):
            a = h.sow(v + 1.0, tag="t", name="a")

            @jax.jit
            def inner(w):
                return h.sow(w * 2.0, tag="t", name="b")

            return inner(a) + a

        return outer(x)

    x = f32(jnp, [1.0, 2.0])
    return {
        "reap": lambda: h.call_and_reap(f, tag="t")(x),
        "plant_inner": lambda: h.plant(f, tag="t")({"b": f32(jnp, [0.0, 0.0])}, x),
        "plant_both": lambda: h.plant(f, tag="t")({"a": f32(jnp, 1.0), "b": f32(jnp, 5.0)}, x),
        "jit_of_reap": lambda: jax.jit(h.reap(f, tag="t"))(x),
        "jit_of_plant": lambda: jax.jit(h.plant(f, tag="t"))({"a": f32(jnp, [3.0, 3.0])}, x),
        "jit_of_harvest": lambda: jax.jit(h.harvest(f, tag="t"))({"b": f32(jnp, [1.0, 1.0])}, x),
    }


@scenario
def vmap_outside(h, jax, jnp):
    """vmap of reap/plant/harvest: reaps gain the batch axis; plants can be batched."""
    f = _two_sows(h)
    xs = f32(jnp, [1.0, 2.0, 3.0])
    return {
        "vmap_reap": lambda: jax.vmap(h.reap(f, tag="t"))(xs),
        "vmap_call_and_reap": lambda: jax.vmap(h.call_and_reap(f, tag="t"))(xs),
        "vmap_plant_batched": lambda: jax.vmap(h.plant(f, tag="t"))(
            {"y": f32(jnp, [0.0, 1.0, 2.0])}, xs
        ),
        "vmap_plant_unbatched": lambda: jax.vmap(h.plant(f, tag="t"), in_axes=(None, 0))(
            {"y": f32(jnp, 5.0)}, xs
        ),
        "vmap_harvest": lambda: jax.vmap(h.harvest(f, tag="t"), in_axes=(None, 0))(
            {"z": f32(jnp, 1.0)}, xs
        ),
    }


@scenario
def vmap_inside(h, jax, jnp):
    """Sows inside vmap: reap batched and unbatched values; plant batched and scalar values."""

    def f(xs):
        return jax.vmap(lambda x: h.sow(x * 2.0, tag="t", name="y") + 1.0)(xs)

    def g(xs):  # sow of an unbatched closed-over value inside the vmap
        c = jnp.sum(xs)
        return jax.vmap(lambda x: x + h.sow(c, tag="t", name="c"))(xs)

    xs = f32(jnp, [1.0, 2.0, 3.0])
    return {
        "reap": lambda: h.call_and_reap(f, tag="t")(xs),
        "plant_batched": lambda: h.plant(f, tag="t")({"y": f32(jnp, [0.0, 10.0, 20.0])}, xs),
        "plant_scalar": lambda: h.plant(f, tag="t")({"y": f32(jnp, 7.0)}, xs),
        "reap_unbatched_sow": lambda: h.reap(g, tag="t")(xs),
        "nested_vmap": lambda: h.reap(jax.vmap(f), tag="t")(jnp.stack([xs, xs * 10.0])),
    }


@scenario
def grad_of_harvested(h, jax, jnp):
    """grad through reap (d reaped/dx), plant (d out/d planted) and harvest."""
    f = _two_sows(h)
    x = f32(jnp, 1.5)
    return {
        "grad_reap_z": lambda: jax.grad(lambda x: h.reap(f, tag="t")(x)["z"])(x),
        "grad_call_and_reap_out": lambda: jax.grad(lambda x: h.call_and_reap(f, tag="t")(x)[0])(x),
        "grad_plant_wrt_plant": lambda: jax.grad(lambda p: h.plant(f, tag="t")({"y": p}, x))(
            f32(jnp, 2.0)
        ),
        "grad_plant_wrt_x": lambda: jax.grad(
            lambda x: h.plant(f, tag="t")({"y": f32(jnp, 2.0)}, x)
        )(x),
        "grad_harvest_both": lambda: jax.grad(
            lambda p, x: h.harvest(f, tag="t")({"y": p}, x)[1]["z"], argnums=(0, 1)
        )(f32(jnp, 2.0), x),
        "value_and_grad_plant": lambda: jax.value_and_grad(
            lambda x: h.plant(f, tag="t")({"z": x * x}, x)
        )(x),
    }


@scenario
def harvest_of_grad(h, jax, jnp):
    """reap/plant of grad(f) and jvp(f): sows inside differentiated code."""

    def f(x):
        y = h.sow(jnp.sin(x), tag="t", name="y")
        return y * x

    x = f32(jnp, 0.5)
    return {
        "reap_grad": lambda: h.call_and_reap(jax.grad(f), tag="t")(x),
        "plant_grad": lambda: h.plant(jax.grad(f), tag="t")({"y": f32(jnp, 3.0)}, x),
        "reap_jvp": lambda: h.call_and_reap(lambda x: jax.jvp(f, (x,), (f32(jnp, 1.0),)), tag="t")(
            x
        ),
        "plant_jvp": lambda: h.plant(lambda x: jax.jvp(f, (x,), (f32(jnp, 1.0),)), tag="t")(
            {"y": f32(jnp, 3.0)}, x
        ),
        "reap_value_and_grad": lambda: h.reap(jax.value_and_grad(f), tag="t")(x),
    }


# --------------------------------------------------------------------------
# Loops
# --------------------------------------------------------------------------


def _scan_fn(h, jax, mode):
    def body(carry, x):
        v = h.sow(carry * 0.5 + x, tag="t", name="x", mode=mode)
        return v, v * 2.0

    def f(init):
        return jax.lax.scan(body, init, jax.numpy.arange(5.0))

    return f


@scenario
def scan_append(h, jax, jnp):
    """append in scan stacks one value per iteration (also reverse, jit)."""
    f = _scan_fn(h, jax, "append")

    def rev(init):
        def body(c, x):
            return c + h.sow(x * c, tag="t", name="x", mode="append"), None

        return jax.lax.scan(body, init, jnp.arange(1.0, 4.0), reverse=True)

    def vec(init):
        def body(c, x):
            h.sow({"v": c * x, "i": x}, tag="t", name="tree", mode="append")
            return c + 1.0, None

        return jax.lax.scan(body, init, f32(jnp, [[1.0, 2.0], [3.0, 4.0]]))[0]

    init = f32(jnp, 1.0)
    return {
        "harvest": lambda: h.harvest(f, tag="t")({}, init),
        "jit_reap": lambda: jax.jit(h.reap(f, tag="t"))(init),
        "reverse": lambda: h.call_and_reap(rev, tag="t")(init),
        "pytree_vector": lambda: h.reap(vec, tag="t")(f32(jnp, [1.0, 1.0])),
    }


@scenario
def scan_clobber(h, jax, jnp):
    """clobber in scan reaps the final iteration's value."""
    f = _scan_fn(h, jax, "clobber")
    init = f32(jnp, 1.0)
    return {
        "harvest": lambda: h.harvest(f, tag="t")({}, init),
        "disable_jit": lambda: jax.disable_jit()(h.reap(f, tag="t"))(init),
        "jit_reap": lambda: jax.jit(h.reap(f, tag="t"))(init),
    }


@scenario
def scan_plant(h, jax, jnp):
    """plant into scan: append takes per-iteration values; clobber one value (array or Python float)."""
    fa = _scan_fn(h, jax, "append")
    fc = _scan_fn(h, jax, "clobber")
    init = f32(jnp, 1.0)
    return {
        "append_plant": lambda: h.plant(fa, tag="t")(
            {"x": f32(jnp, [10.0, 20.0, 30.0, 40.0, 50.0])}, init
        ),
        "clobber_plant": lambda: h.plant(fc, tag="t")({"x": f32(jnp, 3.0)}, init),
        "clobber_plant_python_float": lambda: h.plant(fc, tag="t")({"x": 3.0}, init),
        "append_harvest": lambda: h.harvest(fa, tag="t")({"x": jnp.zeros(5, jnp.float32)}, init),
        "clobber_harvest_python_float": lambda: h.harvest(fc, tag="t")({"x": 3.0}, init),
    }


@scenario
def scan_errors_and_nesting(h, jax, jnp):
    """strict in scan raises; nested scans stack append reaps per level."""
    fs = _scan_fn(h, jax, "strict")

    def nested(init):
        def outer(c, xs):
            def inner(c2, x):
                v = h.sow(c2 + x, tag="t", name="v", mode="append")
                return v, None

            c, _ = jax.lax.scan(inner, c, xs)
            return c, h.sow(c, tag="t", name="o", mode="append")

        return jax.lax.scan(outer, init, jnp.arange(6.0).reshape(2, 3))

    def scan_jit_cond(init):  # scan over a jitted body holding a cond
        def body(c, x):
            def tb(x):
                return h.sow(x + c, tag="t", name="x", mode="append")

            def fb(x):
                return h.sow(x, tag="t", name="x", mode="append")

            x = jax.lax.cond(True, tb, fb, x)
            return x, x

        return jax.lax.scan(jax.jit(body), init, jnp.arange(5.0))

    init = f32(jnp, 1.0)
    return {
        "strict_reap": lambda: h.reap(fs, tag="t")(init),
        "strict_plant": lambda: h.plant(fs, tag="t")({"x": f32(jnp, 0.0)}, init),
        "nested_reap": lambda: h.call_and_reap(nested, tag="t")(init),
        "scan_jit_cond": lambda: h.harvest(scan_jit_cond, tag="t")({}, init),
    }


@scenario
def fori_loop_static(h, jax, jnp):
    """fori_loop with static bounds (a scan): append stacks, clobber keeps last."""

    def f(mode):
        def body(i, c):
            return h.sow(c * 2.0 + i, tag="t", name="c", mode=mode)

        return lambda init: jax.lax.fori_loop(0, 4, body, init)

    init = f32(jnp, 1.0)
    return {
        "append_reap": lambda: h.call_and_reap(f("append"), tag="t")(init),
        "clobber_reap": lambda: h.call_and_reap(f("clobber"), tag="t")(init),
        "append_plant": lambda: h.plant(f("append"), tag="t")(
            {"c": f32(jnp, [1.0, 2.0, 3.0, 4.0])}, init
        ),
        "clobber_plant": lambda: h.plant(f("clobber"), tag="t")({"c": f32(jnp, 0.5)}, init),
        "clobber_plant_python_float": lambda: h.plant(f("clobber"), tag="t")({"c": 0.5}, init),
    }


@scenario
def fori_loop_dynamic(h, jax, jnp):
    """fori_loop with a traced upper bound (jit; a while_loop): clobber ok, append raises."""

    def f(mode):
        def body(i, c):
            return h.sow(c + i, tag="t", name="c", mode=mode)

        return lambda n, init: jax.lax.fori_loop(0, n, body, init)

    n, init = jnp.array(4), f32(jnp, 1.0)
    return {
        "clobber_reap": lambda: jax.jit(h.call_and_reap(f("clobber"), tag="t"))(n, init),
        "clobber_plant": lambda: jax.jit(h.plant(f("clobber"), tag="t"))(
            {"c": f32(jnp, 2.0)}, n, init
        ),
        "append_reap": lambda: jax.jit(h.reap(f("append"), tag="t"))(n, init),
        "zero_trip_reap": lambda: jax.jit(h.call_and_reap(f("clobber"), tag="t"))(
            jnp.array(0), init
        ),
        "concrete_upper_append": lambda: h.reap(f("append"), tag="t")(n, init),
    }


@scenario
def sow_cond_in_loops(h, jax, jnp):
    """sow_cond in fori_loop (scan and while): reap the iteration where pred held."""
    length = 4

    def body(step, x):
        x = x * 2.0 + step
        # one sow_cond per possible step; only the one for `step` fires
        outs = [h.sow_cond(x, step == k, tag="t", name=f"x{k}") for k in range(length + 1)]
        picked = x
        for k, o in enumerate(outs):
            picked = jnp.where(step == k, o, picked)
        return picked

    def f(upper, init):
        return jax.lax.fori_loop(0, upper, body, init)

    def g(init):
        return jax.lax.fori_loop(0, length, body, init)

    init = f32(jnp, 1.0)
    return {
        "scan_reap": lambda: h.reap(g, tag="t")(init),
        "scan_harvest": lambda: h.harvest(g, tag="t")({"x2": 0.5}, init),
        "scan_harvest_array_plant": lambda: h.harvest(g, tag="t")({"x2": f32(jnp, 0.5)}, init),
        "while_reap": lambda: jax.jit(h.reap(f, tag="t"))(jnp.array(length), init),
        "while_harvest": lambda: jax.jit(h.harvest(f, tag="t"))(
            {"x2": f32(jnp, 0.5)}, jnp.array(length), init
        ),
    }


@scenario
def scan_mixed_clobber_and_sow_cond(h, jax, jnp):
    """A scan body mixing a clobber name and a sow_cond name."""

    def f(init):
        def body(c, x):
            a = h.sow(c + x, tag="t", name="a", mode="clobber")
            b = h.sow_cond(c * x, x < 2.0, tag="t", name="b")
            return a + b * 0.0, None

        return jax.lax.scan(body, init, jnp.arange(4.0))[0]

    init = f32(jnp, 1.0)
    return {
        "reap": lambda: h.call_and_reap(f, tag="t")(init),
        "plant_a": lambda: h.plant(f, tag="t")({"a": f32(jnp, 0.0)}, init),
    }


@scenario
def while_loop(h, jax, jnp):
    """while_loop: clobber reaps the last iteration, plants apply every iteration."""

    def cond(c):
        return c[0] < 4

    def body(c):
        i, v, w = c
        v = h.sow(v * 2.0, tag="t", name="x", mode="clobber")
        w = h.sow(w - v, tag="t", name="y", mode="clobber")
        return i + 1, v + 1.0, w

    def strict_body(c):
        i, v, w = c
        return i + 1, h.sow(v, tag="t", name="x") * 3.0, w

    def f(init):
        return jax.lax.while_loop(cond, body, init)

    def fs(init):
        return jax.lax.while_loop(cond, strict_body, init)

    init = (jnp.array(0), f32(jnp, 1.0), f32(jnp, 0.0))
    return {
        "reap": lambda: h.call_and_reap(f, tag="t")(init),
        "plant_x": lambda: h.plant(f, tag="t")({"x": f32(jnp, 5.0)}, init),
        "plant_x_reap_y": lambda: h.call_and_reap(h.plant(f, tag="t"), tag="t")(
            {"x": f32(jnp, 5.0)}, init
        ),
        "zero_trip": lambda: h.reap(f, tag="t")((jnp.array(9), f32(jnp, 1.0), f32(jnp, 2.0))),
        "strict_reap": lambda: h.reap(fs, tag="t")(init),
        "strict_plant": lambda: h.plant(fs, tag="t")({"x": f32(jnp, 1.0)}, init),
        "disable_jit_reap": lambda: jax.disable_jit()(h.reap(f, tag="t"))(init),
    }


# --------------------------------------------------------------------------
# Conditionals
# --------------------------------------------------------------------------


def _cond_fn(h, jax):
    def f(pred, x):
        def tb(x):
            return h.sow(x * 4.0, tag="t", name="x") - 1.0

        def fb(x):
            return h.sow(x - 3.0, tag="t", name="x") * 5.0

        return jax.lax.cond(pred, tb, fb, x)

    return f


@scenario
def cond_reap_plant(h, jax, jnp):
    """cond with the same sow name in both branches: reap the taken one, plant both."""
    f = _cond_fn(h, jax)
    x = f32(jnp, 1.0)
    T, F = jnp.array(True), jnp.array(False)
    return {
        "reap_true": lambda: h.call_and_reap(f, tag="t")(T, x),
        "reap_false": lambda: h.call_and_reap(f, tag="t")(F, x),
        "plant_true": lambda: h.plant(f, tag="t")({"x": f32(jnp, 4.0)}, T, x),
        "plant_false": lambda: h.plant(f, tag="t")({"x": f32(jnp, 4.0)}, F, x),
        "python_bool_pred": lambda: h.call_and_reap(f, tag="t")(False, x),
        "jit_harvest": lambda: jax.jit(h.harvest(f, tag="t"))({}, F, x),
        "vmap_pred": lambda: jax.vmap(h.call_and_reap(f, tag="t"))(
            jnp.array([True, False]), f32(jnp, [1.0, 2.0])
        ),
    }


@scenario
def cond_branch_mismatch(h, jax, jnp):
    """cond branches whose sows differ in name / count / shape, under reap and plant."""

    def make(tb, fb):
        return lambda p, x: jax.lax.cond(p, tb, fb, x)

    def sx(x):
        return h.sow(x, tag="t", name="x") + 1.0

    def sy(x):
        return h.sow(x, tag="t", name="y") + 2.0

    def sxy(x):
        return h.sow(h.sow(x, tag="t", name="x"), tag="t", name="y") + 2.0

    def svec(x):
        return jnp.sum(h.sow(jnp.stack([x, x]), tag="t", name="x"))

    def none(x):
        return x + 5.0

    x, T = f32(jnp, 1.0), jnp.array(True)
    return {
        "names_reap": lambda: h.reap(make(sx, sy), tag="t")(T, x),
        "names_plant": lambda: h.plant(make(sx, sy), tag="t")({}, T, x),
        "count_reap": lambda: h.reap(make(sx, sxy), tag="t")(T, x),
        "shape_reap": lambda: h.reap(make(sx, svec), tag="t")(T, x),
        "shape_plant": lambda: h.plant(make(sx, svec), tag="t")({}, T, x),
        "one_branch_only": lambda: h.reap(make(sx, none), tag="t")(T, x),
        "other_tag_ignores": lambda: h.reap(make(sx, sy), tag="other")(T, x),
    }


@scenario
def switch_reap_plant(h, jax, jnp):
    """lax.switch with the same sow name in all branches: reap/plant by index."""

    def f(i, x):
        branches = (
            lambda x: h.sow(x * 10.0, tag="t", name="x") + 1.0,
            lambda x: h.sow(x - 4.0, tag="t", name="x") * 2.0,
            lambda x: h.sow(jnp.cos(x), tag="t", name="x") - 0.5,
        )
        return jax.lax.switch(i, branches, x)

    x = f32(jnp, 1.0)
    out = {}
    for i in range(3):
        out[f"reap_{i}"] = lambda i=i: h.call_and_reap(f, tag="t")(jnp.array(i), x)
        out[f"plant_{i}"] = lambda i=i: h.plant(f, tag="t")({"x": f32(jnp, 4.0)}, jnp.array(i), x)
    out["clamped_index"] = lambda: h.call_and_reap(f, tag="t")(jnp.array(7), x)
    return out


@scenario
def cond_sow_modes(h, jax, jnp):
    """cond branches sowing in clobber and append modes, and sow_cond in a branch."""

    def f(mode):
        def g(p, x):
            return jax.lax.cond(
                p,
                lambda x: h.sow(x * 2.0, tag="t", name="x", mode=mode),
                lambda x: h.sow(x * 3.0, tag="t", name="x", mode=mode),
                x,
            )

        return g

    def fc(p, q, x):
        return jax.lax.cond(
            p,
            lambda x: h.sow_cond(x * 2.0, q, tag="t", name="x"),
            lambda x: h.sow_cond(x * 3.0, q, tag="t", name="x"),
            x,
        )

    x, T, F = f32(jnp, 1.0), jnp.array(True), jnp.array(False)
    return {
        "clobber_false": lambda: h.call_and_reap(f("clobber"), tag="t")(F, x),
        "append_true": lambda: h.call_and_reap(f("append"), tag="t")(T, x),
        "sow_cond_TT": lambda: h.reap(fc, tag="t")(T, T, x),
        "sow_cond_FF": lambda: h.reap(fc, tag="t")(F, F, x),
        "sow_cond_plant": lambda: h.plant(fc, tag="t")({"x": f32(jnp, 9.0)}, F, F, x),
    }


# --------------------------------------------------------------------------
# remat, custom_jvp, custom_vjp, pmap
# --------------------------------------------------------------------------


@scenario
def remat_checkpoint(h, jax, jnp):
    """Sows inside jax.checkpoint are reaped/planted, also under grad and nesting."""

    def f(x):
        @jax.checkpoint
        def g(v):
            return jnp.sin(h.sow(v * 2.0, tag="t", name="y"))

        return g(x) * x

    def nested(x):
        @jax.checkpoint
        def outer(v):
            @jax.checkpoint
            def inner(w):
                return h.sow(jnp.cos(w), tag="t", name="z")

            return inner(v) * v

        return outer(x)

    x = f32(jnp, 0.5)
    return {
        "reap": lambda: h.call_and_reap(f, tag="t")(x),
        "plant": lambda: h.plant(f, tag="t")({"y": f32(jnp, 1.0)}, x),
        "reap_grad": lambda: h.reap(jax.grad(f), tag="t")(x),
        "grad_plant": lambda: jax.grad(lambda x: h.plant(f, tag="t")({"y": f32(jnp, 1.0)}, x))(x),
        "grad_reap": lambda: jax.grad(lambda x: h.reap(f, tag="t")(x)["y"])(x),
        "nested_reap": lambda: h.reap(nested, tag="t")(x),
        "nested_grad_plant": lambda: jax.grad(
            lambda x: h.plant(nested, tag="t")({"z": f32(jnp, 2.0)}, x)
        )(x),
        "nested_reap_grad": lambda: h.reap(jax.grad(nested), tag="t")(x),
    }


def _custom_jvp_fn(h, jax, jnp):
    @jax.custom_jvp
    def f(x):
        return jnp.sin(h.sow(x * 2.0, tag="t", name="y"))

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), 10.0 * t  # deliberately not the true derivative

    return f


@scenario
def custom_jvp(h, jax, jnp):
    """custom_jvp: reap/plant the primal's sows; the custom rule survives reap/plant."""
    f = _custom_jvp_fn(h, jax, jnp)

    @jax.custom_jvp
    def g(x):
        return x * 3.0

    @g.defjvp
    def g_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return g(x), h.sow(t * 7.0, tag="t", name="tan")

    x = f32(jnp, 0.5)
    return {
        "reap": lambda: h.call_and_reap(f, tag="t")(x),
        "plant": lambda: h.plant(f, tag="t")({"y": f32(jnp, 1.0)}, x),
        "grad_of_reaped": lambda: jax.grad(lambda x: h.call_and_reap(f, tag="t")(x)[0])(x),
        "grad_of_planted": lambda: jax.grad(lambda x: h.plant(f, tag="t")({"y": f32(jnp, 1.0)}, x))(
            x
        ),
        "reap_of_jvp": lambda: h.call_and_reap(
            lambda x: jax.jvp(f, (x,), (f32(jnp, 1.0),)), tag="t"
        )(x),
        "reap_sow_in_jvp_rule": lambda: h.call_and_reap(
            lambda x: jax.jvp(g, (x,), (f32(jnp, 1.0),)), tag="t"
        )(x),
    }


@scenario
def custom_jvp_rule_sows(h, jax, jnp):
    """Sows in a custom_jvp's JVP rule: reaped/planted where jax.jvp or grad runs the rule."""

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        h.sow(x * 2.0, tag="t", name="x")
        h.sow(t * 3.0, tag="t", name="tan")
        return x, t * 2.0

    @jax.custom_jvp
    def g(x):
        return jnp.sin(x)

    @g.defjvp
    def g_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        y = h.sow(x * 2.0, tag="t", name="y")
        return x + y, t * 2.0 + y

    x, one = f32(jnp, 2.0), f32(jnp, 1.0)
    car = lambda fn: h.call_and_reap(fn, tag="t")
    return {
        "reap_undifferentiated": lambda: car(f)(x),
        "jvp_of_reap": lambda: jax.jvp(car(f), (x,), (one,)),
        "jvp_of_jit_of_reap": lambda: jax.jvp(jax.jit(car(f)), (x,), (one,)),
        "grad_of_reap": lambda: jax.grad(lambda x: car(f)(x)[0])(x),
        "grad_of_reaped_value": lambda: jax.grad(lambda x: car(f)(x)[1]["x"])(x),
        "plant_undifferentiated": lambda: h.plant(g, tag="t")({"y": f32(jnp, 0.5)}, x),
        "jvp_of_plant": lambda: jax.jvp(
            h.plant(g, tag="t"), ({"y": f32(jnp, 0.5)}, x), ({"y": f32(jnp, 0.25)}, one)
        ),
    }


@scenario
def plant_python_number(h, jax, jnp):
    """A Python number planted into a site of another dtype (a sown Python int)."""

    def f(x):
        y = h.sow(717, tag="t", name="y")
        return h.sow(x, tag="t", name="x") + y

    def loop(x):
        def body(c):
            i, v = c
            return i + 1, v + h.sow(i, tag="t", name="i", mode="clobber")

        return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    plant = lambda fn: h.plant(fn, tag="t")
    return {
        "float_into_int": lambda: plant(f)({"x": 2.0, "y": 15.0}, f32(jnp, 1.0)),
        "fraction_into_int": lambda: plant(f)({"y": 15.5}, f32(jnp, 1.0)),
        "float_into_int_in_while": lambda: plant(loop)({"i": 2.0}, f32(jnp, 1.0)),
        "vmap_float_into_int_in_while": lambda: jax.vmap(lambda x: plant(loop)({"i": 2.0}, x))(
            jnp.arange(3.0, dtype=jnp.float32)
        ),
    }


def _custom_vjp_fn(h, jax, jnp):
    @jax.custom_vjp
    def f(x):
        return jnp.sin(h.sow(x * 2.0, tag="t", name="y"))

    def fwd(x):
        return f(x), x

    def bwd(x, g):
        return (g * 10.0,)  # deliberately not the true derivative

    f.defvjp(fwd, bwd)
    return f


@scenario
def custom_vjp(h, jax, jnp):
    """custom_vjp: reap/plant the primal's sows; grad still uses the custom bwd."""
    f = _custom_vjp_fn(h, jax, jnp)

    @jax.custom_vjp
    def g(x):
        return x * 3.0

    def g_fwd(x):
        return g(x), h.sow(x + 1.0, tag="t", name="res")

    def g_bwd(res, ct):
        return (ct * res,)

    g.defvjp(g_fwd, g_bwd)

    x = f32(jnp, 0.5)
    return {
        "reap": lambda: h.call_and_reap(f, tag="t")(x),
        "plant": lambda: h.plant(f, tag="t")({"y": f32(jnp, 1.0)}, x),
        "grad_of_reaped": lambda: jax.grad(lambda x: h.call_and_reap(f, tag="t")(x)[0])(x),
        "grad_of_planted": lambda: jax.grad(lambda x: h.plant(f, tag="t")({"y": f32(jnp, 1.0)}, x))(
            x
        ),
        "reap_sow_in_fwd": lambda: h.call_and_reap(jax.grad(g), tag="t")(x),
        "plant_sow_in_fwd": lambda: h.plant(jax.grad(g), tag="t")({"res": f32(jnp, 4.0)}, x),
    }


@scenario
def pmap_one_device(h, jax, jnp):
    """pmap over a leading axis of size 1: reap/plant inside, and pmap of reap."""
    f = _two_sows(h)
    xs = f32(jnp, [[1.0, 2.0]])
    pf = jax.pmap(f)
    return {
        "reap_of_pmap": lambda: h.call_and_reap(pf, tag="t")(xs),
        "plant_into_pmap": lambda: h.plant(pf, tag="t")({"y": f32(jnp, [[0.0, 5.0]])}, xs),
        "pmap_of_reap": lambda: jax.pmap(h.reap(f, tag="t"))(xs),
        "pmap_of_plant": lambda: jax.pmap(h.plant(f, tag="t"))({"z": f32(jnp, [[3.0, 4.0]])}, xs),
    }


# --------------------------------------------------------------------------
# JSON encoding (shared by record_golden.py and compare.py)
# --------------------------------------------------------------------------


def _leaf_value(a: np.ndarray):
    """Nested lists of Python scalars; float32/16 via their shortest repr."""
    if a.dtype.kind == "f" and a.dtype.itemsize < 8:
        return (
            np.vectorize(lambda v: float(str(v)), otypes=[object])(a).tolist()
            if a.ndim
            else float(str(a[()]))
        )
    return a.tolist()


def encode(tree) -> Any:
    """Encodes a scenario result as JSON-ready data.

    * dict  -> JSON object (keys must be str)
    * tuple -> {"__tuple__": [...]};  list -> {"__list__": [...]}
    * None  -> null;  str -> {"__str__": s}
    * Raised -> {"__error__": TypeName, "message": "..."}
    * anything else -> np.asarray(x) as
      {"__array__": dtype, "shape": [...], "value": nested lists}
      (Python scalars show up as float64/int64/bool arrays).
    """
    if isinstance(tree, Raised):
        return {"__error__": tree.type_name, "message": tree.message}
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            if not isinstance(k, str):
                raise TypeError(f"non-str dict key {k!r}")
            out[k] = encode(v)
        return out
    if isinstance(tree, tuple):
        return {"__tuple__": [encode(v) for v in tree]}
    if isinstance(tree, list):
        return {"__list__": [encode(v) for v in tree]}
    if tree is None:
        return None
    if isinstance(tree, str):
        return {"__str__": tree}
    a = np.asarray(tree)
    return {"__array__": str(a.dtype), "shape": list(a.shape), "value": _leaf_value(a)}
