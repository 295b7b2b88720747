"""Which leaves of a call are arrays (traced), which are NNX graph nodes, and
outputs that are not arrays.

The leaf module of the calling convention (see `_tracing`): `_sow`, `_site`
and every module that tells a traced leaf from a static one ask here, by
type first, at C speed.
"""

from __future__ import annotations

import functools
import itertools
import numbers
import operator
import sys
import types
from typing import Any

import jax
import numpy as np

from .. import _jax


def is_array(leaf):
    """Whether a leaf of the arguments is traced (a JAX or NumPy array, or a tracer)."""
    if type(leaf) in ARRAY_TYPES:  # a set lookup: `jax.Array`'s ABC check costs more per leaf
        return True
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, *_jax.LITERAL_TYPES)):
        ARRAY_TYPES.add(type(leaf))
        return True
    return False


ARRAY_TYPES: set[type] = set()  # the types seen to be arrays (the check is by type alone)


def array_flags(leaves: list[Any]) -> list[bool]:
    """`is_array` of each leaf: by type first, at C speed (a model's state is hundreds
    of arrays), then the full check for the leaves of other types."""
    flags = list(map(ARRAY_TYPES.__contains__, map(type, leaves)))
    for i in itertools.compress(range(len(leaves)), map(operator.not_, flags)):
        flags[i] = is_array(leaves[i])
    return flags


def traced_as_data(leaf: Any) -> bool:
    """Arrays are traced (see `_tracing`); so are numbers given as planted values
    or held in NNX state, which are data, not configuration: sweeping them does
    not recompile. Not a bool (it would trace as bool, not the site's dtype) nor
    an int beyond int32, whose value a trace would not keep."""
    if is_array(leaf):
        return True
    if not isinstance(leaf, numbers.Number) or isinstance(leaf, bool):
        return False
    return not isinstance(leaf, int) or -(2**31) <= leaf < 2**31


# ---------------------------------------------------------------------------
# NNX graph nodes, told apart without importing Flax.


def nnx_module():
    return sys.modules.get("flax.nnx")  # only a program that imported it holds its graph nodes


def is_graph_node(value: Any) -> bool:
    kind = type(value)
    if kind in NEVER_NODES or kind in ARRAY_TYPES:
        return False  # the common leaves, told apart without NNX's checks (~5 µs each)
    registered = _registered()
    known = _node_types.get(kind)
    if known is not None and _node_types_registered[0] == registered:
        return known
    nnx = nnx_module()
    if nnx is None:
        return False
    # For any type but an array's, NNX tells a graph node by its type alone:
    # remembered per type while no new type is registered as a graph node.
    known = nnx.graph.is_graph_node(value)
    if registered >= 0 and not isinstance(value, jax.Array):  # a ref is told by its value
        if _node_types_registered[0] != registered or len(_node_types) > 1024:
            _node_types.clear()
            _node_types_registered[0] = registered
        _node_types[kind] = known
    return known


_node_types: dict[type, bool] = {}
_node_types_registered = [-1]  # how many graph node types NNX had when they were remembered


def _registered() -> int:
    """How many graph node types NNX knows; -1 if that cannot be told (nothing is remembered then)."""
    registry = getattr(sys.modules.get("flax.nnx.graphlib"), "GRAPH_REGISTRY", None)
    return -1 if registry is None else len(registry)


NEVER_NODES = frozenset(
    {
        tuple,
        list,
        dict,
        type(None),
        str,
        int,
        float,
        bool,
        type,
        types.FunctionType,
        types.BuiltinFunctionType,
        types.ModuleType,
        functools.partial,
    }
)


# ---------------------------------------------------------------------------
# Outputs that are not arrays.


class _StaticOutput:
    """A non-array leaf of a traced function's output (a string, a Python number,
    an object), held in the output's tree structure rather than as a traced value,
    so it reaches the caller as itself, as ``equinox.filter_jit`` returns it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _StaticOutput)
            and type(self.value) is type(other.value)
            and (self.value is other.value or bool(self.value == other.value))
        )

    def __hash__(self) -> int:
        return 0  # compared by value only where two output structures meet


jax.tree_util.register_pytree_node(
    _StaticOutput, lambda s: ((), s.value), lambda v, _: _StaticOutput(v)
)


def hide_static(out: Any) -> Any:
    """`out` with each non-array leaf wrapped so that tracing carries it as structure."""
    return jax.tree_util.tree_map(lambda leaf: leaf if is_array(leaf) else _StaticOutput(leaf), out)


def reveal_static(out: Any) -> Any:
    """`out` (a traced function's output, rebuilt from its output structure) with
    the leaves `hide_static` wrapped given back as the function returned them."""
    structure = jax.tree_util.tree_structure(out)
    try:
        if structure in _without_static:
            return out
    except Exception:  # auxiliary data that cannot be compared: looked at every time
        pass
    leaves, tree = jax.tree_util.tree_flatten(out, is_leaf=_is_static_output)
    if not any(map(_is_static_output, leaves)):
        try:
            _without_static[structure] = None
            if len(_without_static) > 256:
                _without_static.pop(next(iter(_without_static)))
        except Exception:
            pass
        return out
    return jax.tree_util.tree_unflatten(
        tree, [leaf.value if isinstance(leaf, _StaticOutput) else leaf for leaf in leaves]
    )


def _is_static_output(leaf: Any) -> bool:
    return isinstance(leaf, _StaticOutput)


# The output structures (as compiled walks give them) seen to hold no `_StaticOutput`, so
# that they hold none of the caller's values; the most recent last.
_without_static: dict[Any, None] = {}


def static_key(leaf: Any) -> Any:
    """What a static leaf is keyed by: itself (by hash and ``==``, as `jax.jit` keys
    a static argument), a float or complex also by its repr (``-0.0 == 0.0``, yet
    ``copysign`` tells them apart; ``nan != nan``)."""
    if type(leaf) in (float, complex):
        return (leaf, repr(leaf))
    return leaf


def static_leaves(leaves: list[Any], traced: list[bool]) -> tuple[Any, ...]:
    """``(index, type, leaf, static_key)`` of each leaf not traced: the type keeps 1,
    1.0 and True apart, the key -0.0 and 0.0."""
    return tuple(
        (i, type(leaves[i]), leaves[i], static_key(leaves[i]))
        for i in itertools.compress(range(len(leaves)), map(operator.not_, traced))
    )


def is_named_array(value: Any) -> bool:
    """Whether `value` is a Penzai named array (`pz.nx.NamedArray` or a view of one)."""
    named_axes = sys.modules.get("penzai.core.named_axes")  # none can exist before it loads
    return named_axes is not None and isinstance(value, named_axes.NamedArrayBase)
