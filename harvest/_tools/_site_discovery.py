"""The sow sites of a function's program, found once per function and abstract signature.

Finding the sites a sweep patches traces the model, which on a repeated sweep
cost as much as running the compiled program. So they are kept, keyed as
`jax.jit` keys its traces: by the function (held weakly), the shapes and dtypes
of the traced leaves of what it is given and binds (an NNX module's state
included), and every other leaf's value (`static_key`; the NNX graph definition
among them). `jax.clear_caches()` clears them too.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax

from .. import _jax
from .._calling._inspect import sow_firings
from .._calling._jit import unwrap
from .._calling._nnx_state import forget_verified_splits, split_leaves, with_graph
from .._calling._tracing import make_jaxpr
from .._walk._leaves import is_array, is_graph_node, static_key
from .._walk._site import Site

# One sow site's firing: (site, the bodies it is in, how often it fires, how many rows reap stacks).
Firing = tuple[Site, tuple[str, ...], "int | None", int]

_PER_FUNCTION = 16  # signatures kept per function, the oldest dropped first
_found: weakref.WeakKeyDictionary[Callable[..., Any], dict[Any, tuple[Firing, ...]]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


class _Clearer:
    """Lets ``jax.clear_caches()`` forget the sites found, as it forgets traces."""

    def cache_clear(self) -> None:
        with _lock:
            _found.clear()
            _state_seen.clear()

    def cache_info(self) -> str:
        return f"{len(_found)} functions"

    def cache_keys(self) -> list[Any]:
        return list(_found.keys())


_clearer = _Clearer()  # JAX holds it weakly
_jax.clear_with_jax(_clearer, "harvest: the sow sites of the sweeps' models")
clear_sites = _clearer.cache_clear  # and `harvest.clear_caches()`


def sow_sites(f: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Firing, ...]:
    """Every sow of ``f(*args)``'s program, in program order, as `sow_firings` gives
    them (each equation as its `Site`); traced only for a signature not seen before."""
    fn, bound = unwrap(f)
    key = _signature(fn, bound, args)
    table = None
    with _lock:
        try:
            table = None if key is None else _found.setdefault(fn, {})
        except TypeError:  # a function that cannot be weakly referenced: found every time
            pass
        found = None if table is None else table.get(key)
    if found is not None:
        return found
    closed = make_jaxpr(f, args, {})[0]
    forget_verified_splits()  # tracing ran user code: splits are checked again after it
    found = tuple(
        (Site.of(eqn), where, fires, stacked)
        for eqn, where, fires, stacked in sow_firings(closed.jaxpr)
    )
    if table is not None:
        with _lock:
            table[key] = found
            while len(table) > _PER_FUNCTION:
                del table[next(iter(table))]
    return found


def _signature(fn: Callable[..., Any], bound: Any, args: tuple[Any, ...]) -> Any:
    """What the trace of ``fn`` bound to ``bound`` on ``args`` depends on, hashable; None if it cannot be."""
    leaves, treedef = jax.tree_util.tree_flatten((bound, args), is_leaf=is_graph_node)
    leaves, graph, _ = split_leaves(leaves)
    # A model's state is keyed apart, by its arrays' identity; its graph definition
    # is in the tree structure (see `with_graph`).
    state = () if graph is None else graph.leaves
    key = (with_graph(treedef, graph), tuple(map(_abstract, leaves)), _state_abstract(fn, state))
    try:
        hash(key)
    except TypeError:  # an unhashable static leaf
        return None
    return key


def _state_abstract(fn: Callable[..., Any], leaves: Any) -> Hashed:
    """`_abstract` of each leaf of an NNX state, as data; the last call's again if these are
    its very arrays (held weakly), so a repeated sweep does not look at them again."""
    seen = _state_seen.get(fn)
    if (
        seen is not None
        and len(seen[0]) == len(leaves)
        and all(map(operator.is_, map(_CALL, seen[0]), leaves))
    ):
        return seen[1]
    abstract = Hashed(tuple(_abstract(leaf, data=True) for leaf in leaves))
    try:
        _state_seen[fn] = (tuple(map(weakref.ref, leaves)), abstract)
    except TypeError:  # a number in the state, or a function held only strongly: not kept
        pass
    return abstract


_CALL = operator.methodcaller("__call__")  # a weak reference's referent, at C speed


class Hashed:
    """A value in a key, its hash computed once: a key found again holds the same one
    (a model state's abstract leaves, a sweep's sites)."""

    __slots__ = ("value", "hash")

    def __init__(self, value: Any) -> None:
        self.value: Any = value
        self.hash: int | None = None

    def __hash__(self) -> int:
        if self.hash is None:  # a TypeError for an unhashable value, when a key is hashed
            self.hash = hash(self.value)
        return self.hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Hashed) and self.value == other.value)


_state_seen: weakref.WeakKeyDictionary[Callable[..., Any], tuple[tuple[Any, ...], Hashed]] = (
    weakref.WeakKeyDictionary()
)


def _abstract(leaf: Any, data: bool = False) -> Any:
    """A leaf as the trace sees it: an array (or a number in NNX state, which is
    data) by its shape and dtype, anything else by its value."""
    if is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
        return ("array", leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False))
    if data:
        return ("number", type(leaf))
    return (type(leaf), static_key(leaf))
