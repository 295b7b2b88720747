"""Every compiled program harvest keeps, in JAX's own jit caches.

Two keys, one mechanism (a `jax.jit` whose static argument is everything that
shapes the program, its arrays traced):

* `jit_per_function`: the walk of each harvested function (`_transforms`),
  one `jax.jit` per plain Python function, held weakly by it, so its programs
  go when the function goes, as `jax.jit(f)`'s do;
* `jit_on_arrays` / `compile_program`: the sweeps' programs, one `jax.jit` for
  them all, keyed by what shapes a program (the function, metric, sites,
  axes) and not by the arrays it reads, so a repeated sweep on new data only
  runs.

`jax.clear_caches()` clears both.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax

from ._calling import call_merged, is_array, split_nodes, static_key
from ._interventions import pytree_dataclass

_jits: weakref.WeakKeyDictionary[Callable[..., Any], Any] = weakref.WeakKeyDictionary()
_jits_lock = threading.Lock()


def jit_per_function(fn: Callable[..., Any], walk_weak: Callable[..., Any]) -> Any:
    """``jax.jit(partial(walk_weak, weakref.ref(fn)), static_argnums=1)``, made once per
    ``fn`` and dropped when ``fn`` is collected (``walk_weak`` takes the weak reference)."""
    with _jits_lock:
        jitted = _jits.get(fn)
        if jitted is None:
            # Holds `fn` only weakly, or the dict's value would keep its key alive.
            jitted = _jits[fn] = jax.jit(
                functools.partial(walk_weak, weakref.ref(fn)), static_argnums=1
            )
        return jitted


def jit_on_arrays(fn: Callable[[Any], Any], tree: Any, key: tuple[Any, ...] | None) -> Any:
    """`jax.jit(fn)(tree)`, with `tree`'s arrays traced and its other leaves static.

    NNX graph nodes in `tree` are split first, so their state is traced too,
    and merged into fresh nodes inside the trace (changes to them are not
    written back: a sweep is a measurement). Calls with equal `key` (which
    says everything `fn` closes over that shapes the program) and equal static
    leaves share one compiled program: only the first traces and compiles,
    later ones with the same shapes just run it. `key=None` compiles for this
    call only.
    """
    tree, graph, _ = split_nodes(tree)
    leaves, treedef = jax.tree_util.tree_flatten((tree, graph))
    traced = [is_array(leaf) for leaf in leaves]
    static = _Compiled(
        (
            key,
            treedef,
            tuple(
                (i, type(l), static_key(l)) for i, (l, a) in enumerate(zip(leaves, traced)) if not a
            ),
        )
    )
    arrays = [leaf for leaf, a in zip(leaves, traced) if a]
    rebuilt = functools.partial(_rebuilt, fn, treedef, leaves, traced)
    try:
        hash(static)
        cached = key is not None
    except TypeError:  # an unhashable static leaf
        cached = False
    if not cached:
        return jax.jit(rebuilt)(arrays)
    static.trace = rebuilt
    try:
        return _run_compiled(static, arrays)
    finally:
        static.trace = None  # the cache keeps the key, not this call's function and arrays


def _rebuilt(
    fn: Callable[[Any], Any], treedef: Any, leaves: list[Any], traced: list[bool], arrays: list[Any]
) -> Any:
    it = iter(arrays)
    tree, graph = treedef.unflatten([next(it) if a else leaf for leaf, a in zip(leaves, traced)])
    if graph is not None:  # fresh NNX nodes holding the traced state
        tree = call_merged(lambda t: t, (tree,), {}, graph)[0]
    return fn(tree)


class _Compiled:
    """`_run_compiled`'s static argument: compared by `key` alone; `trace` is the
    current call's function, read only when JAX traces (a new key or new shapes)."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self.trace: Callable[[Any], Any] | None = None

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Compiled) and self.key == other.key


@functools.partial(jax.jit, static_argnums=0)
def _run_compiled(static: _Compiled, arrays: list[Any]) -> Any:
    # One jit for every sweep: its cache (bounded, cleared by jax.clear_caches)
    # holds one program per key and set of shapes.
    assert static.trace is not None
    return static.trace(arrays)


@pytree_dataclass(data=("self",), meta=("func",))
class _BoundMethod:
    """A bound method whose `self` is a pytree (an Equinox module, say), as a pytree: its arrays are data."""

    func: Callable[..., Any]
    self: Any

    def __call__(self, *args: Any) -> Any:
        return self.func(self.self, *args)


def compile_program(
    program: Callable[[Any, Any], Any], f: Callable[..., Any], operands: Any, spec: tuple[Any, ...]
) -> Any:
    """`program(f, operands)`, compiled once per `spec` and shapes (see `jit_on_arrays`).

    A plain function `f` is part of the key (held weakly, so the cache does not
    keep it alive), as under `jax.jit`. A module -- an NNX graph node, a pytree
    such as an Equinox module, or a bound method of either -- is data: its
    arrays are traced, so weights changed in place (or a new module of the
    same structure) reuse the program and are read at every call. Any other
    callable compiles for this call only.
    """
    if inspect.isfunction(f):
        return jit_on_arrays(lambda ops: program(f, ops), operands, (weakref.ref(f), *spec))
    if (
        inspect.ismethod(f)
        and not split_nodes(f)[2]
        and jax.tree_util.tree_leaves(f.__self__) != [f.__self__]
    ):
        f = _BoundMethod(f.__func__, f.__self__)
    if split_nodes(f)[2] or jax.tree_util.tree_leaves(f) != [f]:
        return jit_on_arrays(lambda tree: program(*tree), (f, operands), ("module", *spec))
    return jit_on_arrays(lambda ops: program(f, ops), operands, None)
