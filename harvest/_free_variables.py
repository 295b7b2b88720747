"""What a harvested function reads besides its arguments, and the compile-cache key of it.

The rule (stated for users in docs/semantics.md, "What harvest reads at each
call, and what when it traces"): at every call, harvest reads *which object*
each name the function uses refers to -- its closure cells, the module-level
names its code uses (in the lambdas, comprehensions and generator
expressions inside it too), its defaults and, for a plain method, the
attributes of its object:

* an immutable value (a number, string, bytes, None, a tuple or frozenset of
  them, a frozen dataclass) is keyed by value (a float by its repr, so
  ``0.0``, ``-0.0`` and ``nan`` are three keys);
* an array (JAX or NumPy) in a cell or a global is a traced input, read at
  every call (a default or an attribute that is an array: by identity);
* a tuple or registered pytree of arrays and immutable values, or a list or
  dict of arrays only, is taken apart: its arrays traced, the rest by value;
* an NNX graph node is split, its state traced, as an argument's is;
* anything else (a dict, list, set, a mutable object, a function, a module,
  a class) is keyed by identity.

The *contents* of a value keyed by identity -- a dict's items, an object's
attributes, a helper function's own globals -- are read when the function is
traced, as `jax.jit` reads them: a counter the function updates does not
re-trace it. `harvest.config.update("check_stale", True)` finds a call that a
changed content would have answered otherwise (see `_stale`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import jax

from ._leaves import is_array, is_graph_node

# How many items a tuple may hold to be keyed by them: a larger one is keyed by
# identity (a tuple cannot change; a new one re-traces).
_KEYED_ITEMS = 1024

_IMMUTABLE = frozenset({int, float, complex, bool, str, bytes, type(None)})
_INEXACT = (float, complex)


def value_key(value: Any) -> Any:
    """The key of an immutable value: itself, but a float or complex by its repr
    (``-0.0 == 0.0``, yet ``copysign`` tells them apart; ``nan != nan``)."""
    if type(value) in _INEXACT:
        return repr(value)
    return value


def read_key(value: Any) -> Any:
    """What a value a function reads is keyed by: its value if it is immutable,
    else its identity (see the module's docstring)."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return (kind, value_key(value))
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
    """A value a function reads, not traced: a static leaf of the call, keyed by
    `read_key` (by value if immutable, else by identity); its hash is kept, as
    a call's key is hashed twice."""

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


def static_key(leaf: Any) -> Any:
    """What a static leaf of a call (an argument's, not an array) is keyed by: by
    ``==`` and hash, as `jax.jit` keys a static argument, but a float by its repr
    too (see `value_key`) and a ``functools.partial`` by its function and by
    which objects its arguments are (`read_key`), so a fresh partial of equal
    numbers finds the same program."""
    if type(leaf) in _INEXACT:
        return (leaf, repr(leaf))
    if type(leaf) is functools.partial:
        keywords = tuple((k, read_key(v)) for k, v in sorted(leaf.keywords.items()))
        return (functools.partial, _ByIdentity(leaf.func), read_key(leaf.args), keywords)
    return leaf


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
        items = value.values() if kind is dict else value
        return bool(items) and all(map(_array_only, items))
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
            continue
        values.append(read_part(value))
    return tuple(values)


def with_closure(fn: Any, values: tuple[Any, ...], reads: tuple[tuple[str, Any], ...] = ()) -> Any:
    """``fn`` closing over ``values`` (as ``closure_of`` gave them, their arrays
    perhaps now tracers, their NNX nodes merged copies) instead of its own
    cells, and reading the traced values among ``reads`` (as ``globals_read`` gave
    them) in place of its module's; ``fn`` itself if there is nothing to
    replace, so that its ``nonlocal`` and ``global`` writes still reach their targets."""
    traced = {name: v for name, v in reads if not isinstance(v, StaticValue)}
    own_cells = all(isinstance(v, StaticValue) for v in values)
    if own_cells and not traced:
        return fn
    cells = (
        fn.__closure__
        if own_cells
        else tuple(
            types.CellType()
            if v is EMPTY_CELL
            else types.CellType(v.value if isinstance(v, StaticValue) else v)
            for v in values
        )
    )
    space = {**fn.__globals__, **traced} if traced else fn.__globals__
    copy = types.FunctionType(fn.__code__, space, fn.__name__, fn.__defaults__, cells)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    return copy


def globals_read(fn: Any, defaults: bool = True) -> tuple[tuple[str, Any], ...]:
    """``(name, read_part(value))`` for each module-level name ``fn``'s code uses
    (`names_used`) that its module defines, in name order; with ``defaults``,
    its defaults too, each by `read_key` (an array by identity), under the names
    ``"<defaults>"`` and ``"<kwdefaults>"`` that no global has."""
    code = getattr(fn, "__code__", None)
    space = getattr(fn, "__globals__", None)
    if code is None or space is None:
        return ()
    read = [(name, read_part(space[name])) for name in names_used(code) if name in space]
    if defaults:
        if fn.__defaults__:
            read.append(("<defaults>", StaticValue(fn.__defaults__)))
        if fn.__kwdefaults__:
            read.append(("<kwdefaults>", StaticValue(tuple(sorted(fn.__kwdefaults__.items())))))
    return tuple(read)


@functools.lru_cache(maxsize=4096)
def names_used(code: types.CodeType) -> tuple[str, ...]:
    """The global (and attribute) names ``code`` and the code objects inside it
    (lambdas, comprehensions, generator expressions, inner functions) use, sorted."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(names_used(const))
    return tuple(sorted(names))


def attributes_key(obj: Any) -> Any:
    """What the object of a plain method (not a pytree, not an NNX node) is keyed by
    beside itself: which object each of its attributes is (`read_key`); None for
    any other object (a pytree is flattened as an argument; a value-hashed one is its own key)."""
    if (
        type(obj).__hash__ is not object.__hash__  # type: ignore[comparison-overlap]
        or not hasattr(obj, "__dict__")
        or isinstance(obj, (type, types.FunctionType, types.ModuleType))
        or is_graph_node(obj)
    ):
        return None
    leaves = jax.tree_util.tree_leaves(obj)
    if not (len(leaves) == 1 and leaves[0] is obj):
        return None  # a registered pytree: its leaves are the call's
    return _Attributes(tuple((name, read_key(value)) for name, value in vars(obj).items()))


class _Attributes:
    """`attributes_key`'s key: one static leaf, its hash kept."""

    __slots__ = ("key", "_hash")

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key, self._hash = key, hash(key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Attributes) and self.key == other.key

    def __hash__(self) -> int:
        return self._hash
