"""What a function reads besides its arguments, and the compile-cache key of what is not traced.

The closure cells, the module-level values its code names and its defaults
(see `closure_of`, `globals_read`), and `static_key`: what a static leaf is
keyed by, so that an equal key means the same trace.
"""

from __future__ import annotations

import functools
import numbers
import types
from typing import Any

import jax
import numpy as np

from ._leaves import is_array, is_graph_node


def static_key(leaf: Any, depth: int = 2) -> Any:
    """What a static leaf is keyed by in the compile caches, so that an equal
    key means the same trace: a float by its bits too (``-0.0 == 0.0``, but
    ``copysign`` tells them apart); a dict or tuple (a config a function
    closes over or reads from its module) by its items, so mutating it
    re-traces (up to ``_CONTENT_KEYED`` items; a larger one by identity; a
    list by identity alone, as a list a function appends to is a log of its
    traces, whose every append would otherwise re-trace);
    and an identity-hashed object with attributes (a mutable config, the
    object of a bound method) by their values as well, so mutating one
    re-traces; a ``functools.partial`` by its arguments as well. A NumPy
    array of up to ``_CONTENT_KEYED`` elements is keyed by its bytes (it can
    change in place); within a container or an object, any
    other value that cannot be hashed (a JAX array, a larger NumPy one) by
    identity: rebinding an attribute to a new array re-traces."""
    if isinstance(leaf, (float, complex)):
        return (type(leaf), leaf, repr(leaf))  # repr tells -0.0 and 0.0 apart
    if type(leaf) is np.ndarray and leaf.size <= _CONTENT_KEYED:
        return (np.ndarray, leaf.shape, leaf.dtype.str, leaf.tobytes())  # it can change in place
    if depth <= 0:
        return leaf
    if type(leaf) is functools.partial:  # by its arguments too (a NumPy one can change)
        return (leaf, _part_key(leaf.args, depth - 1), _part_key(leaf.keywords, depth - 1))
    if type(leaf) is dict and all(type(v) in _IMMUTABLE for v in leaf.values()):
        # A flat config, keyed without flattening it: a float by its bits, as above.
        if len(leaf) <= _CONTENT_KEYED:
            return (
                dict,
                tuple((k, static_key(v) if type(v) in _INEXACT else v) for k, v in leaf.items()),
            )
    if type(leaf) in (tuple, dict):
        if len(leaf) > _CONTENT_KEYED:
            return leaf  # not flattened: a vocabulary read at every call would cost its size
        items, structure = jax.tree_util.tree_flatten(leaf, is_leaf=_is_list)
        if len(items) > _CONTENT_KEYED:
            return leaf
        return (structure, tuple(_part_key(item, depth - 1) for item in items))
    if (
        type(leaf).__hash__ is object.__hash__  # type: ignore[comparison-overlap]
        and hasattr(leaf, "__dict__")
        and not isinstance(leaf, (type, types.FunctionType, types.MethodType, types.ModuleType))
    ):
        return (leaf, tuple((k, _part_key(v, depth - 1)) for k, v in sorted(vars(leaf).items())))
    return leaf


_INEXACT = (float, complex)


def _is_list(value: Any) -> bool:
    return type(value) is list


# How many items a container may hold to be keyed by them: a larger one (a
# vocabulary, say) would cost its flattening at every call.
_CONTENT_KEYED = 1024


def _part_key(value: Any, depth: int) -> Any:
    """The key of a value inside a keyed container or object: its ``static_key``,
    or the value by identity if that cannot be hashed."""
    key = static_key(value, depth)
    try:
        hash(key)
    except TypeError:
        return _ByIdentity(value)
    return key


class _ByIdentity:
    """A value in a key by identity (held, so its id is not reused while the key is kept)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByIdentity) and self.value is other.value

    def __hash__(self) -> int:
        return id(self.value)


class StaticValue:
    """A closed-over value kept whole (not flattened): a static leaf, equal to
    another holding the same object with the same ``static_key`` (with
    ``keyed=False``, holding the same object)."""

    def __init__(self, value: Any, keyed: bool = True) -> None:
        self.value = value
        key = static_key(value) if keyed else None  # not keyed: by identity alone
        try:
            self._hash = hash((id(value), key))  # a call's key is hashed twice: kept
        except TypeError:
            key = None  # unhashable: identity alone
            self._hash = hash((id(value), key))
        self.key = key

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, StaticValue) and self.value is other.value and self.key == other.key
        )

    def __hash__(self) -> int:
        return self._hash


_EMPTY = StaticValue(None)  # a cell not yet filled (a name assigned after the def)


def closure_of(fn: Any) -> tuple[Any, ...]:
    """What ``fn`` closes over, one entry per cell: arrays, NNX graph nodes (to be
    split, their state traced, as an argument's is), and containers (tuple,
    list, dict) of arrays and Python numbers, as themselves, so their arrays are
    traced and their numbers keyed; anything else ``StaticValue`` (a list that ``fn``
    appends to stays the caller's list)."""
    cells = getattr(fn, "__closure__", None) or ()
    values = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:
            values.append(_EMPTY)
            continue
        values.append(value if _is_data(value) else StaticValue(value))
    return tuple(values)


def _is_data(value: Any) -> bool:
    """Whether a value a function reads (not an argument) is taken apart, its arrays
    traced: an array, an NNX graph node, or a tuple, list or dict of arrays and
    Python numbers or strings (which are keyed)."""
    if type(value) not in (tuple, list, dict):
        return is_array(value) or is_graph_node(value)
    leaves = jax.tree_util.tree_leaves(value)
    if all(type(leaf) in _IMMUTABLE for leaf in leaves):
        return False  # a config of numbers and strings, told without the array checks
    return any(map(is_array, leaves)) and all(
        is_array(leaf) or isinstance(leaf, (numbers.Number, str)) for leaf in leaves
    )


def with_closure(fn: Any, values: tuple[Any, ...], reads: tuple[tuple[str, Any], ...] = ()) -> Any:
    """``fn`` closing over ``values`` (as ``closure_of`` gave them, their arrays
    perhaps now tracers, their NNX nodes merged copies) instead of its own
    cells, and reading the NNX nodes among ``reads`` (as ``globals_read`` gave
    them) in place of its module's; ``fn`` itself if there is nothing to
    replace, so that its ``nonlocal`` and ``global`` writes still reach their targets."""
    nodes = {name: v for name, v in reads if not isinstance(v, StaticValue)}
    own_cells = all(isinstance(v, StaticValue) for v in values)
    if own_cells and not nodes:
        return fn
    cells = (
        fn.__closure__
        if own_cells
        else tuple(
            types.CellType()
            if v is _EMPTY
            else types.CellType(v.value if isinstance(v, StaticValue) else v)
            for v in values
        )
    )
    space = {**fn.__globals__, **nodes} if nodes else fn.__globals__
    copy = types.FunctionType(fn.__code__, space, fn.__name__, fn.__defaults__, cells)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    return copy


def globals_read(fn: Any) -> tuple[tuple[str, Any], ...]:
    """The module-level numbers, strings, arrays, containers and NNX graph nodes
    ``fn``'s own code reads. A JAX array (by identity: it cannot change), a
    NumPy array of up to ``_CONTENT_KEYED`` elements (by its bytes: it can
    change in place), a number, a string, and a tuple or dict of neither
    arrays nor nodes (by its items: see ``static_key``) are ``StaticValue`` for the
    compile-cache key, so rebinding or mutating one re-traces, as calling
    ``fn`` would see the new value. A larger NumPy array and a container of
    arrays are taken as themselves and traced, as closed-over ones are; each graph node
    as itself, to be split as an argument is, so a weight changed in place or
    a layer replaced is seen. Mutable defaults (a dict, a NumPy array) are
    ``StaticValue`` too, under the names ``"<defaults>"`` and ``"<kwdefaults>"``."""
    code = getattr(fn, "__code__", None)
    space = getattr(fn, "__globals__", None)
    if code is None or space is None:
        return ()
    read = []
    for name in code.co_names:
        value = space.get(name, _UNBOUND)
        if type(value) in _NOT_READ:  # the functions, modules and classes a body calls
            continue
        if is_graph_node(value) or _is_large_numpy(value) or _is_data_container(value):
            read.append((name, value))  # traced, read afresh at every call
        elif type(value) in _CONFIGS or is_array(value) or isinstance(value, (numbers.Number, str)):
            read.append((name, StaticValue(value)))
        elif value is not _UNBOUND:
            # Any other object (an enum, a frozen config, a Linen model): a mutable
            # config object by its attributes too, a callable or a value-hashed one by
            # identity (it cannot change, or its hash would cost a call more than its key).
            by_attributes = type(value).__hash__ is object.__hash__ and not callable(value)  # type: ignore[comparison-overlap]
            read.append((name, StaticValue(value, keyed=by_attributes)))
    # Defaults a call leaves out are read when it is traced: a mutable one (a config
    # dict, a NumPy array) is keyed as a module-level value, under a name no global has.
    for name, defaults in (
        ("<defaults>", getattr(fn, "__defaults__", None)),
        ("<kwdefaults>", getattr(fn, "__kwdefaults__", None)),
    ):
        values = defaults.values() if isinstance(defaults, dict) else defaults or ()
        if not all(type(v) in _IMMUTABLE for v in values):
            read.append((name, StaticValue(defaults)))
    return tuple(read)


def _is_large_numpy(value: Any) -> bool:
    return type(value) is np.ndarray and value.size > _CONTENT_KEYED


def _is_data_container(value: Any) -> bool:
    return type(value) in (tuple, list, dict) and _is_data(value)


_UNBOUND = object()
_IMMUTABLE = frozenset({int, float, complex, bool, str, bytes, type(None), type})
_CONFIGS = (tuple, dict)  # the containers read from a module, keyed by their items
_NOT_READ = frozenset(
    {
        type(_UNBOUND),
        types.FunctionType,
        types.BuiltinFunctionType,
        types.ModuleType,
        type,
        functools.partial,
        type(None),
    }
)
