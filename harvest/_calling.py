"""The calling convention of every harvest transformation: arrays traced, the rest static.

As with `equinox.filter_jit`, the JAX and NumPy arrays among a call's
arguments are traced, and every other leaf -- a Python number, bool, None,
string, callable, enum, a config object -- reaches the function as itself.
So `range(n)` and `if training:` work inside a harvested function, and a
different Python value means a different trace (it is part of the compile
cache key).

Flax NNX graph nodes (modules, `Rngs`, variables) among the arguments, or
bound as the `self` of a method there or of the harvested callable, are split, as `nnx.jit` splits them, into a
static graph definition and their state, whose arrays are traced. Inside the
trace they are merged into fresh objects that the function may mutate (batch
statistics, RNG counters, `Module.sow`); the variables it changed or added
come out as data and are written back to the caller's objects afterwards. So
a harvested call leaves a module exactly as a direct call would.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import sys
import types
from typing import Any

import jax
import numpy as np

from ._primitive import tracing_for_harvest


def is_array(leaf):
    """Whether a leaf of the arguments is traced (a JAX or NumPy array, or a tracer)."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


# ---------------------------------------------------------------------------
# NNX graph nodes: split before the trace, merged inside it, written back after.


def _nnx():
    # Only a program that imported flax.nnx can hold its graph nodes.
    return sys.modules.get("flax.nnx")


@dataclasses.dataclass(frozen=True)
class _Node:
    """Where graph node number `index` of the call stood in the arguments;
    with `method`, a bound method of that node stood there."""

    index: int
    method: Any = None

    def merged(self, fresh):
        node = fresh[self.index]
        return node if self.method is None else types.MethodType(self.method, node)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Graph:
    """The graph nodes of a call, split: a static graph definition and their state."""

    graphdef: Any
    state: Any

    def tree_flatten(self):
        return (self.state,), self.graphdef

    @classmethod
    def tree_unflatten(cls, graphdef, children):
        return cls(graphdef, children[0])


def split_nodes(tree):
    """(`tree` with each NNX graph node replaced by a marker, their `Graph`, the nodes).

    Nodes reachable from several places (a module and its submodule, the same
    module twice) are split together, so they stay shared when merged. Without
    graph nodes, returns `(tree, None, ())`.
    """
    nnx = _nnx()
    if nnx is None:
        return tree, None, ()
    is_node = nnx.graph.is_graph_node

    def node_of(leaf):
        if inspect.ismethod(leaf) and is_node(leaf.__self__):
            return leaf.__self__
        return leaf if is_node(leaf) else None

    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_node)
    nodes: dict[int, Any] = {}
    for leaf in leaves:
        node = node_of(leaf)
        if node is not None:
            nodes.setdefault(id(node), node)
    if not nodes:
        return tree, None, ()
    index = {key: i for i, key in enumerate(nodes)}
    held = []
    for leaf in leaves:
        node = node_of(leaf)
        if node is None:
            held.append(leaf)
        else:
            held.append(_Node(index[id(node)], None if node is leaf else leaf.__func__))
    nodes = tuple(nodes.values())
    graphdef, state = nnx.split(nodes)
    return jax.tree_util.tree_unflatten(treedef, held), Graph(graphdef, state), nodes


def call_merged(f, args, kwargs, graph):
    """`f(*args, **kwargs)` with `graph`'s nodes merged back in (`f` too may be
    one, or a method of one); returns
    (its output, the state of every variable it changed or added)."""
    if graph is None:
        return f(*args, **kwargs), None
    nnx = _nnx()
    fresh = nnx.merge(graph.graphdef, graph.state)
    before = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(fresh))}
    f, args, kwargs = jax.tree_util.tree_map(
        lambda leaf: leaf.merged(fresh) if isinstance(leaf, _Node) else leaf, (f, args, kwargs)
    )
    out = f(*args, **kwargs)
    changed = [
        (path, var)
        for path, var in nnx.to_flat_state(nnx.state(fresh))
        if path not in before or var.get_value() is not before[path]
    ]
    return out, nnx.from_flat_state(changed)


def write_back(nodes, changes):
    """Gives the caller's graph nodes the state a call left in their merged copies."""
    if nodes and changes:
        _nnx().update(nodes, changes)


# ---------------------------------------------------------------------------
# Tracing under the convention.


def make_jaxpr(f, args, kwargs, graph=None, return_shape=False):
    """`jax.make_jaxpr` of `f(*args, **kwargs)`, tracing only arrays.

    Array leaves are traced (so are `jax.ShapeDtypeStruct`s, so a function's
    sites can be found from shapes alone, and numbers in NNX state, which are
    data); everything else is closed over. NNX graph nodes in the arguments
    (and `f` itself, if it is one or a method of one) are split and merged
    (`graph` is given when the caller split them already). The traced function returns `(f's output, changed NNX state)`.
    Returns the closed jaxpr, the traced leaves in order, and, if
    `return_shape`, the traced function's output shape. Sows keep their effect
    while tracing, so dead-code elimination and partial evaluation (of `grad`,
    `scan`, ...) cannot drop a bare one.
    """
    if graph is None:
        (f, args, kwargs), graph, _ = split_nodes((f, args, kwargs))
    leaves, tree = jax.tree_util.tree_flatten((f, args, kwargs, graph))
    in_state = range(tree.num_leaves - (0 if graph is None else len(jax.tree_util.tree_leaves(graph))), tree.num_leaves)
    positions = [
        i
        for i, leaf in enumerate(leaves)
        if is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct) or (i in in_state and isinstance(leaf, numbers.Number))
    ]

    def flat_f(*arrays):
        filled = list(leaves)
        for i, a in zip(positions, arrays):
            filled[i] = a
        return call_merged(*jax.tree_util.tree_unflatten(tree, filled))

    arrays = [leaves[i] for i in positions]
    with tracing_for_harvest():
        traced = jax.make_jaxpr(flat_f, return_shape=return_shape)(*arrays)
    if return_shape:
        closed, out_shape = traced
        return closed, arrays, out_shape
    return traced, arrays
