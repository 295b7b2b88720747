"""How a harvested function is called eagerly: one `jax.jit` per function, JAX's cache the only cache.

The contract is `jax.jit(f)`'s (docs/semantics.md): at every call, arrays are
traced and every other leaf is a static argument, keyed as `jax.jit` keys them
(by hash and ``==``; a float also by its bits, so ``0.0`` and ``-0.0`` differ);
what the function reads besides its arguments is read when JAX traces it. Each
function gets one wrapper, in a weak dictionary, holding one `jax.jit` whose
static `Key` says which body to run (a walk, a sweep's program) and with what.

A bound method, a ``functools.partial`` or a callable pytree (an Equinox or
instrumented module) is split into its function, which owns the wrapper, and
what it binds, passed as an argument, as ``equinox.filter_jit`` takes a bound module.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax

from .. import config
from .._walk._leaves import array_flags, is_graph_node, static_leaves
from ._nnx_state import (
    call_merged,
    changes_discarded,
    forget_verified_splits,
    rebuilt,
    split_leaves,
    state_flags,
    with_graph,
)


class RecompileWarning(UserWarning):
    """harvest keeps tracing and compiling the same function: each call pays for it."""


def unwrap(f: Any) -> tuple[Any, Any]:
    """(function, bound data: a method's object, a partial's arguments) such that
    `rewrap(function, data)` behaves as `f`. A callable object whose class's
    ``__call__`` is not Python code (a ``jax.jit``-wrapped function) is its own function."""
    if isinstance(f, functools.partial):
        fn, inner = unwrap(f.func)
        return fn, ("partial", inner, f.args, f.keywords)
    if inspect.ismethod(f):
        return f.__func__, ("method", f.__self__)
    if inspect.isfunction(f):
        return f, None
    call = next((vars(k)["__call__"] for k in type(f).__mro__ if "__call__" in vars(k)), None)
    if inspect.isfunction(call):  # a module, an instrumented model: its class's code plus itself
        return call, ("method", f)
    return f, None


def rewrap(fn: Any, data: Any) -> Any:
    if data is None:
        return fn
    if data[0] == "method":
        return functools.partial(fn, data[1])
    _, inner, args, keywords = data
    return functools.partial(rewrap(fn, inner), *args, **keywords)


class Key:
    """The static argument of a function's one `jax.jit`: which body runs
    (``run(fn, dynamic, key)``) and what else but arrays shapes its program
    (``fields``), hashed once. ``alike(fields)`` gives the fields but Python values
    (for the recompile warning). ``payload``, read only if JAX traces, is what the
    fields determine (a sweep's program), not compared."""

    __slots__ = ("run", "fields", "alike", "payload", "_hash")

    def __init__(
        self, run: Callable[..., Any], fields: Any, alike: Callable[[Any], Any], payload: Any = None
    ) -> None:
        self.run, self.fields = run, fields
        self.alike = alike
        self.payload = payload
        self._hash: int | None = None

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((self.run, self.fields))  # TypeError for an unhashable leaf
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Key)
            and self.run is other.run
            and (self.fields is other.fields or self.fields == other.fields)
        )


def _wrapper(ref: weakref.ref[Any]) -> Any:
    """One function's `jax.jit`, holding the function weakly (see the module's docstring)."""

    def staged(dynamic: Any, key: Key) -> Any:
        fn = ref()
        assert fn is not None, "traced after its function was collected"
        _note_trace(fn, dynamic, key)
        return key.run(fn, dynamic, key)

    return jax.jit(staged, static_argnums=1)


_wrappers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def compiled(fn: Any, dynamic: Any, key: Key) -> Any:
    """``key.run(fn, dynamic, key)`` through ``fn``'s one `jax.jit`, ``key`` its static
    argument; run now, uncompiled, for a key that cannot be hashed or a function
    that cannot be held weakly (warned once per function: every call traces)."""
    try:
        hash(key)
        wrapper = _wrappers.get(fn)
        if wrapper is None:
            wrapper = _wrappers[fn] = _wrapper(weakref.ref(fn))
    except TypeError:
        _note_unhashable(fn, key)
        return jax.jit(lambda d: key.run(fn, d, key))(dynamic)
    return wrapper(dynamic, key)


def compiled_on_arrays(fn: Any, run: Callable[..., Any], tree: Any, spec: Any, payload: Any) -> Any:
    """``run(fn, tree, payload)`` through ``fn``'s one `jax.jit`, ``tree``'s arrays (and
    numbers in NNX state, `state_flags`) traced and its other leaves static; ``spec``
    says what else shapes the program (hashable), ``payload`` is what ``spec``
    determines (see `Key`). NNX nodes in ``tree`` are split
    and merged into fresh nodes inside the trace; what the program changes in them is
    dropped (a sweep is a measurement)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_graph_node)
    leaves, graph, _ = split_leaves(leaves)
    state = () if graph is None else graph.leaves
    flat = [*leaves, *state]
    traced = array_flags(leaves) + state_flags(graph)
    fields = (run, spec, with_graph(treedef, graph), static_leaves(flat, traced))
    key = Key(_on_arrays, fields, _alike_on_arrays, payload)
    return compiled(fn, list(itertools.compress(flat, traced)), key)


def _alike_on_arrays(fields: tuple[Any, ...]) -> Any:
    run, spec, treedef, static = fields
    return (run, treedef, tuple(kind for _, kind, _, _ in static))


def _on_arrays(fn: Any, arrays: list[Any], key: Key) -> Any:
    run, spec, treedef, static = key.fields
    tree, graph = rebuilt(treedef, static, arrays)
    forget_verified_splits()  # the trace runs user code: splits are checked again after it
    if graph is None:
        return run(fn, tree, key.payload)
    with changes_discarded():  # fresh NNX nodes: what the program changes in them is dropped
        return run(fn, call_merged(lambda t: t, (tree,), {}, graph)[0], key.payload)


def clear_caches() -> None:
    """Drops every compiled program harvest's transformations hold, and JAX's caches.

    Each harvested function's programs are its one ``jax.jit``'s: this forgets
    those and calls ``jax.clear_caches()``, so the next call of each function traces
    afresh, reading its closure and module as they are now, as ``jax.jit(f)`` does.

    Returns:
        None.

    Example:
        >>> import jax.numpy as jnp
        >>> import harvest
        >>> config = {"scale": 2.0}
        >>> f = lambda x: harvest.sow(x * config["scale"], name="y", mode="strict")
        >>> reaped = harvest.reap(f)
        >>> reaped(jnp.ones(2))["y"]
        Array([2., 2.], dtype=float32)
        >>> config["scale"] = 3.0  # read when f is traced, as jax.jit reads it
        >>> harvest.clear_caches()
        >>> reaped(jnp.ones(2))["y"]
        Array([3., 3.], dtype=float32)
    """
    _wrappers.clear()
    _traced.clear()
    jax.clear_caches()


# -- the one warning: a function traced again and again ---------------------

# Traces per (code, shapes, what else but Python values shapes the program), the most
# recent kept: a long process tracing many shapes forgets the oldest counts.
_traced: collections.OrderedDict[Any, int] = collections.OrderedDict()
_TRACED_KEPT = 4096
_warned: weakref.WeakSet[Any] = weakref.WeakSet()


def _code(fn: Any) -> Any:
    with contextlib.suppress(ValueError):  # a cycle of __wrapped__
        fn = inspect.unwrap(fn)
    return getattr(fn, "__code__", None)


def _where(fn: Any) -> str:
    code = _code(fn)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    return name if code is None else f"{name} ({code.co_filename}:{code.co_firstlineno})"


def _note_trace(fn: Any, dynamic: Any, key: Key) -> None:
    """Counts a trace that a kept program could have served had only a Python value
    not changed (a fresh closure, a new number); warns once past ``warn_after``."""
    code = _code(fn)
    if code is None:
        return
    shapes = tuple(
        (getattr(a, "shape", ()), str(getattr(a, "dtype", "")))
        for a in jax.tree_util.tree_leaves(dynamic)
    )
    counted: tuple[Any, ...] = (code, shapes, key.run, key.alike(key.fields))
    try:
        hash(counted)
    except TypeError:
        counted = (code, shapes, key.run)
    n = _traced[counted] = _traced.pop(counted, 0) + 1
    if len(_traced) > _TRACED_KEPT:
        _traced.popitem(last=False)
    if n > config.warn_after and code not in _warned:
        _warn(
            fn,
            f"harvest has traced and compiled {_where(fn)} {n} times for the same shapes. A static "
            "argument changes between calls (a new Python number or other non-array argument: pass it "
            "as an array to trace it), or a fresh function each call (harvest it once, outside the "
            "loop), as jax.jit would retrace. Shown once per function; harvest.config.update("
            "'warn_after', n) sets when.",
        )


def _note_unhashable(fn: Any, key: Key) -> None:
    code = _code(fn)
    culprit = _unhashable_in(key.fields)
    if code is None or code in _warned or culprit is None:  # None: fn cannot be held weakly
        return
    _warn(
        fn,
        f"harvest traces and compiles {_where(fn)} at every call: a non-array argument of type "
        f"{type(culprit).__name__} cannot be hashed, so jax.jit cannot keep a program for it (it "
        "would refuse it as a static argument). Make it hashable (a tuple instead of a list, a "
        "frozen dataclass) or pass its numbers as arrays. Shown once per function.",
    )


def _unhashable_in(x: Any) -> Any:
    """The innermost value of ``x`` (through tuples) that cannot be hashed; None if it can."""
    try:
        hash(x)
    except TypeError:
        for item in x if isinstance(x, tuple) else ():
            found = _unhashable_in(item)
            if found is not None:
                return found
        return x
    return None


def _warn(fn: Any, message: str) -> None:
    """Warns, once per function, at the line that defines ``fn`` (the one the message names)."""
    code = _code(fn)
    _warned.add(code)
    warnings.warn_explicit(message, RecompileWarning, code.co_filename, code.co_firstlineno)
