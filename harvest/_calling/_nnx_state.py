"""Flax NNX graph nodes: split before the trace, merged inside it, written back after.

The one split/merge path: harvest's walk (`_run_walk.run_walk`), the sweeps'
programs (`_jit.compiled_on_arrays`) and their site discovery split a call's
leaves through `split_leaves` (the kept split, `_SplitCache`), lay the state's
leaves after them (`with_graph`, `rebuilt`) and merge through `call_merged`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import operator
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import jax

from .._walk._leaves import is_graph_node, nnx_module, traced_as_data
from ._stateful import held_states


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
    """The graph nodes of a call, split: a static graph definition, and their
    state as its flat leaves and their structure (rebuilt only when merged)."""

    graphdef: Any
    statedef: Any
    leaves: tuple[Any, ...]
    arrays: bool = False  # known to be all arrays (a kept split's, read again)

    @property
    def state(self) -> Any:
        return self.statedef.unflatten(self.leaves)

    def tree_flatten(self):
        return self.leaves, (self.graphdef, self.statedef)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux, tuple(children))


def _node_of(leaf: Any) -> Any:
    if inspect.ismethod(leaf) and is_graph_node(leaf.__self__):
        return leaf.__self__
    return leaf if is_graph_node(leaf) else None


def split_leaves(leaves: list[Any]) -> tuple[list[Any], Graph | None, tuple[Any, ...]]:
    """(`leaves` with each NNX graph node, or bound method of one, replaced by a
    marker, their `Graph`, the nodes), for leaves flattened ``is_leaf=is_graph_node``;
    without graph nodes, `(leaves, None, ())`. The nodes are split together, so
    those reachable from several places stay shared when merged."""
    nnx = nnx_module()
    found = [] if nnx is None else list(map(_node_of, leaves))
    nodes = {id(node): node for node in found if node is not None}
    if not nodes:
        return leaves, None, ()
    index = {key: i for i, key in enumerate(nodes)}
    marked = [
        leaf if node is None else _Node(index[id(node)], None if node is leaf else leaf.__func__)
        for leaf, node in zip(leaves, found)
    ]
    split = tuple(nodes.values())
    return marked, _split_cache.graph(nnx, split), split


def state_flags(graph: Graph | None) -> list[bool]:
    """Which leaves of a split's state are traced: its arrays and its numbers (data,
    not configuration: a changed number does not recompile), on every path."""
    if graph is None:
        return []
    return [True] * len(graph.leaves) if graph.arrays else list(map(traced_as_data, graph.leaves))


def split_nodes(tree: Any) -> tuple[Any, Graph | None, tuple[Any, ...]]:
    """(`tree` with each NNX graph node replaced by a marker, their `Graph`, the
    nodes), as `split_leaves`; without graph nodes, `(tree, None, ())`."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_graph_node)
    leaves, graph, nodes = split_leaves(leaves)
    return (tree if graph is None else jax.tree_util.tree_unflatten(treedef, leaves)), graph, nodes


def with_graph(treedef: Any, graph: Graph | None) -> Any:
    """The structure of a tree's leaves (flattened as ``treedef``) followed by
    ``graph``'s state leaves: one tree structure holding ``graph`` without its leaves
    (not flattened: ~0.2 µs each), whose definitions are data that JAX compares (the
    one an earlier split gave by identity first) and does not hash (a deep walk)."""
    shape = None if graph is None else Graph(graph.graphdef, graph.statedef, ())
    return jax.tree_util.treedef_tuple((treedef, jax.tree_util.tree_structure(shape)))


def rebuilt(treedef: Any, static: tuple, traced: Any) -> tuple[Any, Graph | None]:
    """(the tree, its `Graph`) of leaves laid out by `with_graph`'s ``treedef``:
    ``static`` holds (index, type, leaf, key) per leaf not traced (`static_leaves`),
    ``traced`` the others in order."""
    tree_def, shape_def = treedef.children()
    shape = shape_def.unflatten(())
    n = tree_def.num_leaves
    total = n + (0 if shape is None else shape.statedef.num_leaves)
    at, it = {i: leaf for i, _, leaf, _ in static}, iter(traced)
    flat = [at[i] if i in at else next(it) for i in range(total)]
    graph = None if shape is None else Graph(shape.graphdef, shape.statedef, tuple(flat[n:]))
    return tree_def.unflatten(flat[:n]), graph


class _Split:
    """One split of some graph nodes, and what tells whether it still holds: each
    node's attributes by identity (a list or dict among them by its items too), the
    values held so that no identity is reused, the top nodes weakly; each node's and
    variable's class; the attributes read from each ``__dict__`` at each check (a
    class or ``__dict__`` assigned past NNX's ``__setattr__`` changes no attribute).
    The state is read from the variables at each call: in-place changes are seen."""

    def __init__(self, nnx: Any, nodes: tuple[Any, ...], graph: Graph, state: Any) -> None:
        self.graphdef, self.statedef, leaves = graph.graphdef, graph.statedef, graph.leaves
        found = dict(nnx.graph.iter_graph(nodes))
        self.variables = [found.get(path) for path, _ in nnx.to_flat_state(state)]
        self.types = list(map(type, leaves))
        tops = {id(n) for n in nodes}
        self.inner = [
            v
            for path, v in found.items()
            if path
            and nnx.graph.is_graph_node(v)
            and not isinstance(v, nnx.Variable)
            and id(v) not in tops
        ]
        owners = (*nodes, *self.inner)
        # Kept if each variable is one leaf of the state, in its order, read directly
        # (a concrete array, no hook on reading: `get_value` copies it through a tree
        # map, some 30 µs a variable), and every node's attributes are in a `__dict__`.
        self.kept = (
            len(self.variables) == len(leaves)
            and all(
                isinstance(v, nnx.Variable)
                and getattr(v, "_raw_value", None) is leaf
                and isinstance(leaf, jax.Array)
                and not isinstance(leaf, jax.core.Tracer)
                and "on_get_value" not in getattr(v, "_var_metadata", ("on_get_value",))
                for v, leaf in zip(self.variables, leaves)
            )
            and all(hasattr(o, "__dict__") for o in owners)
        )
        if not self.kept:
            return
        try:
            self.tops = [weakref.ref(n) for n in nodes]
        except TypeError:  # a node that cannot be weakly referenced
            self.kept = False
            return
        # The attribute dicts themselves (an object keeps its own), so a check is
        # two passes at C speed; holding the values keeps their identities unused.
        self.attrs = [vars(o) for o in owners]
        self.classes = list(map(type, (*owners, *self.variables)))
        lengths, names, self.values = _layout(self.attrs)
        self.layout = (lengths, names)
        self.items = [
            (a, name, _item_ids(value), tuple(value.values() if isinstance(value, dict) else value))
            for a in self.attrs
            for name, value in a.items()
            if isinstance(value, (list, dict))
        ]

    def now(self, nodes: tuple[Any, ...]) -> Graph | None:
        """The graph with the variables' values now; None if the split no longer
        holds for ``nodes`` or a value is no longer an array of its type."""
        if len(nodes) != len(self.tops) or not all(t() is n for t, n in zip(self.tops, nodes)):
            return None
        owners = list(itertools.chain(nodes, self.inner))
        if list(map(type, itertools.chain(owners, self.variables))) != self.classes:
            return None
        lengths, names, values = _layout(list(map(vars, owners)))
        if (
            (lengths, names) != self.layout
            or not all(map(operator.is_, values, self.values))  # an equal array is another
            or not all(_item_ids(a[name]) == ids for a, name, ids, _ in self.items)
        ):
            return None
        leaves = list(map(_RAW_VALUE, self.variables))
        if list(map(type, leaves)) != self.types:
            return None
        return Graph(self.graphdef, self.statedef, tuple(leaves), arrays=True)


_RAW_VALUE = operator.attrgetter("_raw_value")


def _layout(attrs: list[dict[str, Any]]) -> tuple[list[int], list[str], list[Any]]:
    """How many attributes each dict holds, all their names and all their values, flat:
    built in C, some 0.1 ms for a transformer's hundred modules and 2,000 attributes."""
    return (
        list(map(len, attrs)),
        list(itertools.chain.from_iterable(attrs)),
        list(itertools.chain.from_iterable(map(dict.values, attrs))),
    )


def _item_ids(value: Any) -> tuple[Any, ...]:
    if isinstance(value, dict):
        return (*value, *map(id, value.values()))
    return tuple(map(id, value))


class _SplitCache:
    """The last splits of the graph nodes harvest was called on, by the nodes'
    identity, so an eager call of an unchanged module does not walk its graph
    again (the idea of ``nnx.cached_partial``, with the structure checked at
    each call). An entry goes when one of its nodes does; at most ``size`` are kept."""

    size = 16

    def __init__(self) -> None:
        self.splits: dict[tuple[int, ...], _Split] = {}
        self.graphdefs: dict[Any, Any] = {}  # the last graph definitions split, each its own key
        self.lock = threading.Lock()
        self.local = threading.local()  # the splits verified in the current `verified_once`
        self.walks = 0  # how many times a graph was split (the tests count them)

    def graph(self, nnx: Any, nodes: tuple[Any, ...]) -> Graph:
        key = tuple(map(id, nodes))
        verified = getattr(self.local, "verified", None)
        if verified is not None and key in verified:
            return verified[key]
        with self.lock:
            split = self.splits.get(key)
        graph = None if split is None else split.now(nodes)
        if graph is None:
            self.walks += 1
            graphdef, state = nnx.split(nodes)
            leaves, statedef = jax.tree_util.tree_flatten(state)
            graph = Graph(self._interned(graphdef), statedef, tuple(leaves))
            # Nodes made inside a trace (merged there) are new at every trace: never kept.
            if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
                self._keep(key, _Split(nnx, nodes, graph, state), nodes)
        if verified is not None and key in self.splits:
            verified[key] = graph
        return graph

    @contextlib.contextmanager
    def verified_once(self) -> Iterator[None]:
        """Within it (one sweep's call), nodes split once are not checked again:
        no user code runs between the splits but a trace, which `forget_verified` ends."""
        before = getattr(self.local, "verified", None)
        self.local.verified = {} if before is None else before
        try:
            yield
        finally:
            self.local.verified = before

    def forget_verified(self) -> None:
        verified = getattr(self.local, "verified", None)
        if verified is not None:
            verified.clear()

    def _interned(self, graphdef: Any) -> Any:
        """The graph definition equal to ``graphdef`` that an earlier split gave, if any:
        a compile-cache lookup compares graph definitions by identity first, else node
        by node (some 1,300 comparisons for a 12-block transformer, ~3 ms a call)."""
        try:
            hash(graphdef)
        except TypeError:  # static metadata that cannot be hashed: not shared
            return graphdef
        with self.lock:
            kept = self.graphdefs.pop(graphdef, graphdef)
            self.graphdefs[kept] = kept  # most recent last
            while len(self.graphdefs) > self.size:
                self.graphdefs.pop(next(iter(self.graphdefs)))
        return kept

    def _keep(self, key: tuple[int, ...], split: _Split, nodes: tuple[Any, ...]) -> None:
        if not split.kept:
            return
        with self.lock:
            new = self.splits.pop(key, None) is None  # re-added: most recent last
            self.splits[key] = split
            while len(self.splits) > self.size:
                self.splits.pop(next(iter(self.splits)))
        if new:
            for n in nodes:  # the entry goes with the first of its nodes collected
                weakref.finalize(n, self._drop, key)

    def _drop(self, key: tuple[int, ...]) -> None:
        with self.lock:
            self.splits.pop(key, None)


_split_cache = _SplitCache()
splits_verified_once = _split_cache.verified_once
forget_verified_splits = _split_cache.forget_verified


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Changes:
    """The NNX variables a call changed or added: their paths (static) and new states."""

    paths: tuple[tuple[Any, ...], ...] = dataclasses.field(metadata={"static": True})
    variables: tuple[Any, ...]
    states: tuple[Any, ...] = ()  # per `Stateful` object of the call, its state after it

    def keep(self, kept: list[bool]) -> Changes:
        paths = tuple(itertools.compress(self.paths, kept))
        return Changes(paths, tuple(itertools.compress(self.variables, kept)), self.states)


def call_merged(
    f: Any, args: Any, kwargs: Any, graph: Graph | None
) -> tuple[Any, Changes | None, list[Any]]:
    """`f(*args, **kwargs)` with `graph`'s nodes merged back in (`f` too may be
    one, or a method of one); returns its output, the state of every variable
    whose value it replaced or that it added, and, for each of those, the
    value it had before (None for an added one)."""
    if graph is None:
        out = f(*args, **kwargs)
        states = held_states((f, args, kwargs))
        return out, (Changes((), (), states) if states else None), []
    nnx = nnx_module()
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
    changes = Changes(
        tuple(p for p, _ in changed), tuple(v for _, v in changed), held_states((f, args, kwargs))
    )
    return out, changes, [before.get(p) for p in changes.paths]


_measuring = threading.local()


@contextlib.contextmanager
def changes_discarded() -> Iterator[None]:
    """Within it, harvested calls leave NNX nodes' state as it was: a sweep measures
    every patched run from the same state, and its nodes (made in its trace) could
    not take values of the ``vmap`` or ``grad`` inside it anyway."""
    before = getattr(_measuring, "on", False)
    _measuring.on = True
    try:
        yield
    finally:
        _measuring.on = before


def write_back(nodes: tuple[Any, ...], changes: Changes | None, stateful: tuple = ()) -> None:
    """Gives the caller's graph nodes the state a call left in their merged copies,
    and the caller's `Stateful` objects (`stateful_objects` of the call) theirs."""
    if changes is None or getattr(_measuring, "on", False):
        return
    for obj, state in zip(stateful, changes.states):
        if state is not None:
            obj.harvest_write_state(state)
    if not nodes or not changes.paths:
        return
    nnx = nnx_module()
    from flax.errors import TraceContextError

    try:
        nnx.update(nodes, nnx.from_flat_state(zip(changes.paths, changes.variables)))
    except TraceContextError as e:
        # A path starts with the node's place among the call's nodes: shown only if several.
        names = ", ".join(".".join(map(str, p[len(nodes) == 1 :])) for p in changes.paths[:4])
        more = ", ..." if len(changes.paths) > 4 else ""
        raise TraceContextError(
            f"This harvested call changed the NNX state ({names + more}) of a model made outside the "
            "jax.jit/jax.grad/... trace it runs in, and NNX forbids writing values of that trace into "
            "it (calling the model directly there fails the same way). Pass the model through the "
            "transformation instead: nnx.jit/nnx.grad, or nnx.split it, nnx.merge it inside and "
            "return nnx.state(model)."
        ) from e
