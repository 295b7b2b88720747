"""A plain function as data: a callable plant or a sweep's metric, keyed by its
code and what it closes over, so a fresh lambda of the same code does not recompile.
Only a function whose code names no module-level value is taken so (`can_be_data`):
one that reads a global is keyed by identity, as `jax.jit` keys a function, since
nothing in its closure would show the global rebound.

Arrays (and NNX graph nodes, and containers of arrays) it closes over or has as
defaults are traced leaves; an immutable value is static, keyed by value (a float
by its repr); anything else by identity.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import types
import weakref
from collections.abc import Sequence
from typing import Any

import jax

from .._walk._leaves import is_array, is_graph_node, static_key

# How many items a tuple may hold to be keyed by them: a larger one is keyed by
# identity (a tuple cannot change; a new one re-traces).
_KEYED_ITEMS = 1024

_IMMUTABLE = frozenset({int, float, complex, bool, str, bytes, type(None)})


def read_key(value: Any) -> Any:
    """What a value the function reads is keyed by: its value if it is immutable (a
    float or complex by its repr), else its identity."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return (kind, repr(value) if kind is float or kind is complex else value)
    if isinstance(value, (tuple, frozenset)):  # a named tuple too
        if len(value) > _KEYED_ITEMS:
            return _ByIdentity(value)
        items = map(read_key, value)
        return (kind, frozenset(items) if isinstance(value, frozenset) else tuple(items))
    if dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        try:
            hash(value)
        except TypeError:  # a field that cannot be hashed: by identity
            return _ByIdentity(value)
        return (kind, value)
    return _ByIdentity(value)


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
    """A value the function reads, not traced, keyed by `read_key`; its hash is kept."""

    __slots__ = ("value", "key", "_hash")

    def __init__(self, value: Any) -> None:
        self.value = value
        self.key = read_key(value)
        self._hash = hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StaticValue) and self.key == other.key

    def __hash__(self) -> int:
        return self._hash


EMPTY_CELL = StaticValue(None)  # a cell not yet filled (a name assigned after the def)


def read_part(value: Any) -> Any:
    """A value a function reads as part of a call: the value itself if it is traced
    or taken apart (an array, an NNX node, a container of arrays), else a `StaticValue`."""
    return value if _taken_apart(value) else StaticValue(value)


def _taken_apart(value: Any) -> bool:
    if is_array(value) or is_graph_node(value):
        return True
    kind = type(value)
    if kind in _IMMUTABLE:
        return False
    if kind is list or kind is dict:
        return _array_only(value)
    leaves = jax.tree_util.tree_leaves(value, is_leaf=is_graph_node)
    if len(leaves) == 1 and leaves[0] is value:
        return False  # a leaf: not a container
    # A tuple or registered pytree (immutable): arrays traced, immutable values keyed.
    arrays = [is_array(leaf) or is_graph_node(leaf) for leaf in leaves]
    return any(arrays) and all(a or type(leaf) in _IMMUTABLE for a, leaf in zip(arrays, leaves))


def _array_only(value: Any) -> bool:
    """Whether ``value`` (an item of a list or dict) holds arrays or NNX nodes only."""
    if is_array(value) or is_graph_node(value):
        return True
    kind = type(value)
    if kind is list or kind is tuple:
        return bool(value) and all(map(_array_only, value))
    if kind is dict:
        return bool(value) and all(map(_array_only, value.values()))
    return False


def closure_of(fn: Any) -> tuple[Any, ...]:
    """What ``fn`` closes over, one `read_part` per cell (`EMPTY_CELL` for a cell not yet filled)."""
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            values.append(EMPTY_CELL)
        else:
            values.append(read_part(value))
    return tuple(values)


_DEPTH = 2  # how deep closed-over functions are themselves taken apart


@jax.tree_util.register_pytree_node_class
class TracedCode:
    """A plain Python function as a pytree (see the module's docstring): its code,
    closed-over cells and defaults, and closed-over or default plain functions taken
    apart the same way, two levels deep (a plant built from a helper is data too).
    Calling it calls the function rebuilt around its current leaves."""

    def __init__(self, fn: Any, shape: _CodeShape, leaves: Sequence[Any]) -> None:
        self._fn = fn
        self._shape = shape
        self._leaves = tuple(leaves)

    @classmethod
    def of(cls, fn: Any, depth: int = _DEPTH) -> TracedCode:
        """``fn`` (a plain function) as a ``TracedCode``."""
        parts = (
            tuple(_nested(v, depth) for v in closure_of(fn)),
            tuple(_nested(read_part(v), depth) for v in fn.__defaults__ or ()),
            {k: _nested(read_part(v), depth) for k, v in (fn.__kwdefaults__ or {}).items()},
        )
        leaves, treedef = jax.tree_util.tree_flatten(parts, is_leaf=is_graph_node)
        dynamic = [is_array(leaf) or is_graph_node(leaf) for leaf in leaves]
        statics = tuple((i, leaf) for i, (leaf, d) in enumerate(zip(leaves, dynamic)) if not d)
        # Unless something is traced, the function itself is called, so that its
        # `nonlocal` writes still reach its cells.
        shape = _CodeShape(fn, not any(dynamic), treedef, statics)
        return cls(fn, shape, [leaf for leaf, d in zip(leaves, dynamic) if d])

    def function(self) -> Any:
        """The function, closing over this pytree's leaves (perhaps tracers)."""
        if self._fn is None:
            self._fn = self._shape.rebuild(self._leaves)
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function()(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.function())

    def __repr__(self) -> str:
        return repr(self.function())

    def tree_flatten(self) -> tuple[tuple[Any, ...], _CodeShape]:
        return self._leaves, self._shape

    @classmethod
    def tree_unflatten(cls, shape: _CodeShape, leaves: Any) -> TracedCode:
        return cls(None, shape, leaves)


def _nested(part: Any, depth: int) -> Any:
    """A `read_part`, with a plain function among static values taken apart itself."""
    if depth > 0 and isinstance(part, StaticValue) and can_be_data(part.value):
        return TracedCode.of(part.value, depth - 1)
    return part


class _CodeShape:
    """``TracedCode``'s static part: compared by the code and the keys of every
    static value; it holds the values themselves only to rebuild the function,
    and the function weakly (a compile cache keyed by this must not keep it
    alive: only a call, which holds the function, traces)."""

    def __init__(
        self, fn: Any, keep: bool, treedef: Any, statics: tuple[tuple[int, Any], ...]
    ) -> None:
        self.template = weakref.ref(fn)
        self.keep = keep
        self.treedef = treedef
        self.statics = statics
        self.key = (fn.__code__, treedef, tuple((i, type(v), static_key(v)) for i, v in statics))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CodeShape) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def rebuild(self, dynamic: Sequence[Any]) -> Any:
        fn = self.template()
        assert fn is not None, "traced after the function was collected"
        if self.keep:
            return fn
        it, at = iter(dynamic), dict(self.statics)
        leaves = [at[i] if i in at else next(it) for i in range(self.treedef.num_leaves)]
        cells, defaults, kwdefaults = self.treedef.unflatten(leaves)
        rebuilt = types.FunctionType(
            fn.__code__,
            fn.__globals__,  # the module's own namespace, not read: the code looks names up there
            fn.__name__,
            tuple(_value(v) for v in defaults) or None,
            tuple(
                types.CellType() if v is EMPTY_CELL else types.CellType(_value(v)) for v in cells
            ),
        )
        rebuilt.__kwdefaults__ = {k: _value(v) for k, v in kwdefaults.items()} or None
        rebuilt.__qualname__ = fn.__qualname__
        rebuilt.__dict__.update(fn.__dict__)
        return rebuilt


def _value(part: Any) -> Any:
    """What ``read_part`` or ``_nested`` made of a value, back as the value."""
    if isinstance(part, StaticValue):
        return part.value
    if isinstance(part, TracedCode):
        return part.function()
    return part


def code_as_data(plants: Any) -> Any:
    """``plants`` with each plain function in it that `can_be_data` a ``TracedCode``."""
    if not plants:  # no plants: the common call of ``reap``
        return plants
    return jax.tree_util.tree_map(lambda v: TracedCode.of(v) if can_be_data(v) else v, plants)


def can_be_data(fn: Any) -> bool:
    """Whether ``fn`` can be keyed by its code and what it closes over: a plain function
    whose code names no global (see the module's docstring)."""
    return inspect.isfunction(fn) and not _loads_globals(fn.__code__)


@functools.lru_cache(maxsize=4096)
def _loads_globals(code: types.CodeType) -> bool:
    """Whether ``code`` or a code object inside it (a comprehension, a nested lambda)
    looks a name up in its module (read from the bytecode, not from the module)."""
    if any(i.opname in _GLOBAL_LOADS for i in dis.get_instructions(code)):
        return True
    return any(_loads_globals(c) for c in code.co_consts if isinstance(c, types.CodeType))


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
