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

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
import numbers
import operator
import sys
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from . import _errors, _jax
from ._higher_order import describe
from ._primitive import tracing_for_harvest


def is_array(leaf):
    """Whether a leaf of the arguments is traced (a JAX or NumPy array, or a tracer)."""
    if type(leaf) in _ARRAY_TYPES:  # a set lookup: `jax.Array`'s ABC check costs more per leaf
        return True
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, *_jax.LITERAL_TYPES)):
        _ARRAY_TYPES.add(type(leaf))
        return True
    return False


_ARRAY_TYPES: set[type] = set()  # the types seen to be arrays (the check is by type alone)


def array_flags(leaves: list[Any]) -> list[bool]:
    """`is_array` of each leaf: by type first, at C speed (a model's state is hundreds
    of arrays), then the full check for the leaves of other types."""
    flags = list(map(_ARRAY_TYPES.__contains__, map(type, leaves)))
    for i in itertools.compress(range(len(leaves)), map(operator.not_, flags)):
        flags[i] = is_array(leaves[i])
    return flags


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

    def apart(self) -> tuple[GraphShape, tuple[Any, ...]] | None:
        """(its `GraphShape`, its leaves) if every leaf is an array, else None: a
        call's key and flattening then skip the hundreds of leaves of a model's state."""
        if self.arrays or all(map(_ARRAY_TYPES.__contains__, map(type, self.leaves))):
            return GraphShape(self.graphdef, self.statedef), self.leaves
        return None


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class GraphShape:
    """A `Graph` without its leaves, which are all arrays and travel beside it,
    as a pytree with no children (its definitions are the tree structure's data,
    which JAX compares, the one graph definition an earlier split gave by
    identity first, and does not hash)."""

    graphdef: Any
    statedef: Any

    def filled(self, leaves: Any) -> Graph:
        return Graph(self.graphdef, self.statedef, tuple(leaves))

    def tree_flatten(self):
        return (), (self.graphdef, self.statedef)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux)


def split_nodes(tree):
    """(`tree` with each NNX graph node replaced by a marker, their `Graph`, the nodes).

    Nodes reachable from several places (a module and its submodule, the same
    module twice) are split together, so they stay shared when merged. Without
    graph nodes, returns `(tree, None, ())`.
    """
    nnx = _nnx()
    if nnx is None:
        return tree, None, ()
    is_node = _is_graph_node

    def node_of(leaf):
        if inspect.ismethod(leaf) and is_node(leaf.__self__):
            return leaf.__self__
        return leaf if is_node(leaf) else None

    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_node)
    found = list(map(node_of, leaves))
    nodes: dict[int, Any] = {}
    for node in found:
        if node is not None:
            nodes.setdefault(id(node), node)
    if not nodes:
        return tree, None, ()
    index = {key: i for i, key in enumerate(nodes)}
    held = []
    for leaf, node in zip(leaves, found):
        if node is None:
            held.append(leaf)
        else:
            held.append(_Node(index[id(node)], None if node is leaf else leaf.__func__))
    nodes = tuple(nodes.values())
    return jax.tree_util.tree_unflatten(treedef, held), _split_cache.graph(nnx, nodes), nodes


class _Split:
    """One split of some graph nodes, and what tells whether it still holds.

    Each node's attributes are kept by identity (a layer replaced, an attribute
    added, a flag flipped changes one; a list or dict among them by its items
    too), and the values themselves are held so that no identity is reused
    while the split is kept; the top nodes are held weakly. Each node's and
    variable's class is kept too, and the attributes are read from each node's
    ``__dict__`` at each check (a class or a whole ``__dict__`` assigned past
    NNX's ``__setattr__`` changes no attribute). The state is read from the
    variables at each call, so weights changed in place are seen.
    """

    def __init__(self, nnx: Any, nodes: tuple[Any, ...], graphdef: Any, state: Any) -> None:
        self.graphdef = graphdef
        leaves, self.statedef = jax.tree_util.tree_flatten(state)
        self.leaves = tuple(leaves)  # this call's; dropped once the split is kept
        found = dict(nnx.graph.iter_graph(nodes))
        self.variables = [found.get(path) for path, _ in nnx.to_flat_state(state)]
        self.types = list(map(type, leaves))
        self.arrays = all(map(is_array, leaves))
        # Reusable if each variable is one leaf of the state, in its order, read
        # directly: a concrete array, no hook on reading (`get_value` copies it
        # through a tree map, some 30 µs a variable).
        self.reusable = len(self.variables) == len(leaves) and all(
            isinstance(v, nnx.Variable)
            and getattr(v, "_raw_value", None) is leaf
            and isinstance(leaf, jax.Array)
            and not isinstance(leaf, jax.core.Tracer)
            and "on_get_value" not in getattr(v, "_var_metadata", ("on_get_value",))
            for v, leaf in zip(self.variables, leaves)
        )
        tops = {id(n) for n in nodes}
        self.inner = [
            v
            for path, v in found.items()
            if path
            and nnx.graph.is_graph_node(v)
            and not isinstance(v, nnx.Variable)
            and id(v) not in tops
        ]
        try:
            self.tops = [weakref.ref(n) for n in nodes]
        except TypeError:  # a node that cannot be weakly referenced: not kept
            self.tops, self.reusable = [], False
        if not all(hasattr(o, "__dict__") for o in (*nodes, *self.inner)):
            self.inner, self.reusable = [], False  # attributes in slots: not watched, not kept
        # The attribute dicts themselves (an object keeps its own), so a check is
        # two passes at C speed; holding the values keeps their identities unused.
        self.attrs = [vars(o) for o in (*nodes, *self.inner) if hasattr(o, "__dict__")]
        self.classes = list(map(type, (*nodes, *self.inner, *self.variables)))
        self.lengths, self.names, self.values = _attribute_layout(self.attrs)
        self.items = [
            (a, name, _item_ids(value), tuple(value.values() if isinstance(value, dict) else value))
            for a in self.attrs
            for name, value in a.items()
            if isinstance(value, (list, dict))
        ]

    def still_holds(self, nodes: tuple[Any, ...]) -> bool:
        return (
            len(nodes) == len(self.tops)
            and all(t() is n for t, n in zip(self.tops, nodes))
            and list(map(type, itertools.chain(nodes, self.inner, self.variables))) == self.classes
            and _same_layout(
                _attribute_layout(list(map(vars, itertools.chain(nodes, self.inner)))),
                self.lengths,
                self.names,
                self.values,
            )
            and all(_item_ids(a[name]) == ids for a, name, ids, _ in self.items)
        )

    def current(self) -> Graph | None:
        """The graph with the variables' values now; None if one is no longer an array of its type."""
        leaves = list(map(_RAW_VALUE, self.variables))
        if list(map(type, leaves)) != self.types:
            return None
        return Graph(self.graphdef, self.statedef, tuple(leaves), self.arrays)


_RAW_VALUE = operator.attrgetter("_raw_value")


def _attribute_layout(attrs: list[dict[str, Any]]) -> tuple[list[int], list[str], list[Any]]:
    """How many attributes each dict holds, all their names and all their values, flat:
    built in C, some 0.1 ms for a transformer's hundred modules and 2,000 attributes."""
    return (
        list(map(len, attrs)),
        list(itertools.chain.from_iterable(attrs)),
        list(itertools.chain.from_iterable(map(dict.values, attrs))),
    )


def _same_layout(
    layout: tuple[list[int], list[str], list[Any]],
    lengths: list[int],
    names: list[str],
    values: list[Any],
) -> bool:
    """Whether ``layout`` has these lengths and names and these very values (by identity:
    an equal array or variable in a value's place is another object)."""
    now_lengths, now_names, now_values = layout
    return (
        now_lengths == lengths and now_names == names and all(map(operator.is_, now_values, values))
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

    def __init__(self, size: int = 16) -> None:
        self.size = size
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
        graph = self._graph(nnx, nodes, key)
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

    def _graph(self, nnx: Any, nodes: tuple[Any, ...], key: tuple[int, ...]) -> Graph:
        with self.lock:
            split = self.splits.get(key)
        if split is not None and split.still_holds(nodes):
            graph = split.current()
            if graph is not None:
                return graph
        self.walks += 1
        graphdef, state = nnx.split(nodes)
        graphdef = self._interned(graphdef)
        leaves, statedef = jax.tree_util.tree_flatten(state)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            # Nodes made inside a trace (merged there): new at every trace, never kept.
            return Graph(graphdef, statedef, tuple(leaves))
        split = _Split(nnx, nodes, graphdef, state)
        graph = Graph(split.graphdef, split.statedef, split.leaves)
        split.leaves = ()  # the cache keeps the variables, not this call's values
        if split.reusable:
            self._keep(key, split, nodes)
        return graph

    def _interned(self, graphdef: Any) -> Any:
        """The graph definition equal to ``graphdef`` that an earlier split gave, if any.

        Two models of the same structure have equal graph definitions, and every
        compile-cache lookup compares the one it is given with the one it keeps:
        by identity when they are one object, else node by node (some 1,300
        comparisons for a 12-block transformer, ~3 ms a call)."""
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
        with self.lock:
            new = key not in self.splits
            self.splits.pop(key, None)
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


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Changes:
    """The NNX variables a call changed or added: their paths (static) and new states."""

    paths: tuple[tuple[Any, ...], ...]
    variables: tuple[Any, ...]
    states: tuple[Any, ...] = ()  # per `Stateful` object of the call, its state after it

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[tuple[Any, ...], ...]]:
        return (self.variables, self.states), self.paths

    @classmethod
    def tree_unflatten(cls, paths: tuple[tuple[Any, ...], ...], children: Any) -> Changes:
        return cls(paths, tuple(children[0]), tuple(children[1]))

    def keep(self, kept: list[bool]) -> Changes:
        paths, variables = (
            zip(*[(p, v) for p, v, k in zip(self.paths, self.variables, kept) if k])
            if any(kept)
            else ((), ())
        )
        return Changes(tuple(paths), tuple(variables), self.states)


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
    changes = Changes(
        tuple(p for p, _ in changed), tuple(v for _, v in changed), held_states((f, args, kwargs))
    )
    return out, changes, [before.get(p) for p in changes.paths]


def split_of(nodes: tuple[Any, ...]) -> Graph:
    """The split of ``nodes`` (NNX graph nodes), the kept one while their structure holds
    (as `split_nodes` gives it for a call holding exactly these nodes)."""
    return _split_cache.graph(_nnx(), nodes)


def call_on_merged(f: Any, graph: Graph, count: int) -> tuple[Any, Changes]:
    """``f(*nodes)`` on fresh nodes merged from ``graph`` (a split of ``count`` nodes);
    returns its output and the state it changed or added in them, as `call_merged`."""
    out, changes, _ = call_merged(f, tuple(map(_Node, range(count))), {}, graph)
    assert changes is not None  # a graph was merged: its changes are told
    return out, changes


_measuring = threading.local()


@contextlib.contextmanager
def changes_discarded() -> Iterator[None]:
    """Within it, harvested calls leave NNX nodes' state as it was: a sweep
    measures every patched run from the same state, and its nodes (made in
    the sweep's trace) could not take values of the ``vmap`` or ``grad``
    inside it anyway."""
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
    nnx = _nnx()
    from flax.errors import TraceContextError

    try:
        nnx.update(nodes, nnx.from_flat_state(zip(changes.paths, changes.variables)))
    except TraceContextError as e:
        # A path starts with the node's place among the call's nodes: shown only if several.
        names = ", ".join(".".join(map(str, p[len(nodes) == 1 :])) for p in changes.paths[:4])
        more = ", ..." if len(changes.paths) > 4 else ""
        raise _errors.nnx_state_from_another_trace(TraceContextError, names + more) from e


# ---------------------------------------------------------------------------
# Objects holding state of their own (an instrumented Penzai model's
# `pz.StateVariable`s): flattened, they give the state's values, which are
# traced; the copy inside the trace updates its own; its state after the call
# is an output, given to the caller's object afterwards.


class Stateful:
    """Base of a pytree whose traced copy a call may give new state."""

    def harvest_state(self) -> Any:
        """Inside the trace: the state this copy holds now (None: it holds none)."""
        raise NotImplementedError

    def harvest_write_state(self, state: Any) -> None:
        """After the call, on the caller's object: takes `state` as its own."""
        raise NotImplementedError


_flattening_call: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "harvest_flattening_call", default=False
)


@contextlib.contextmanager
def flattening_call() -> Iterator[None]:
    """While harvest flattens one call's parts: a `Stateful` object may flatten to
    a form that is cheaper to flatten again (an instrumented Penzai model gives its
    arrays as direct children), which only harvest's own walk unflattens."""
    token = _flattening_call.set(True)
    try:
        yield
    finally:
        _flattening_call.reset(token)


def in_flattening_call() -> bool:
    return _flattening_call.get()


def stateful_objects(tree: Any) -> tuple[Stateful, ...]:
    """The `Stateful` objects in `tree`, in flattening order (not looking inside NNX
    graph nodes, which hold none and can be large)."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=_special)
    return tuple(x for x in leaves if isinstance(x, Stateful))


def holds_graph_nodes(tree: Any) -> bool:
    """Whether `split_nodes` would find NNX graph nodes in ``tree`` (without splitting them)."""
    return any(
        _is_graph_node(leaf.__self__ if inspect.ismethod(leaf) else leaf)
        for leaf in jax.tree_util.tree_leaves(tree, is_leaf=_is_graph_node)
        if type(leaf) not in _ARRAY_TYPES
    )


def holds_no_nodes(tree: Any) -> bool:
    """Whether ``tree`` holds no NNX graph node (nor a bound method of one) and no
    `Stateful` object, so that `split_nodes` and `stateful_objects` would find
    nothing: one flatten, telling the common leaves apart by type alone."""
    return not any(map(_special, jax.tree_util.tree_leaves(tree, is_leaf=_special)))


def _special(x: Any) -> bool:
    """A `Stateful` object, an NNX graph node or a bound method of either."""
    if type(x) in _NEVER_NODES or type(x) in _ARRAY_TYPES or type(x) is Held:
        return False  # the common nodes and leaves, without the ABC and NNX checks
    if inspect.ismethod(x):
        x = x.__self__
    return isinstance(x, Stateful) or _is_graph_node(x)


def held_states(tree: Any) -> tuple[Any, ...]:
    """The state of each `Stateful` object in `tree` (in `stateful_objects`'s order),
    or () if none holds any."""
    states = tuple(obj.harvest_state() for obj in stateful_objects(tree))
    return states if any(s is not None for s in states) else ()


# ---------------------------------------------------------------------------
# Which variables a call really changed: decided on the jaxpr.


class _Origins:
    """Which input of a jaxpr each of its variables merely is.

    NNX transforms hand every variable of the module they call back as an
    output of their equation (`jit`, `remat`, `scan`, `while`, `cond`): a new
    variable, so a new tracer, that holds the same value when the body returns
    the input unchanged. Following such an output into the body, to the input
    the body returns, finds what it copies.
    """

    def __init__(self) -> None:
        # id(jaxpr) -> (the equation making each variable, the place of each input by id)
        self._index: dict[int, tuple[dict[Any, Any], dict[int, int]]] = {}

    def _indexed(self, jaxpr: Any) -> tuple[dict[Any, Any], dict[int, int]]:
        index = self._index.get(id(jaxpr))
        if index is None:
            made = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
            index = self._index[id(jaxpr)] = (made, {id(v): k for k, v in enumerate(jaxpr.invars)})
        return index

    def of(self, jaxpr: Any, var: Any) -> int | None:
        """The place of the input of `jaxpr` that `var` is a copy of, or None if it is computed."""
        made, inputs = self._indexed(jaxpr)
        while not isinstance(var, _jax.Literal):
            if id(var) in inputs:
                return inputs[id(var)]
            eqn = made.get(var)
            k = None if eqn is None else self._forwarded(eqn, eqn.outvars.index(var))
            if eqn is None or k is None:
                return None
            var = eqn.invars[k]
        return None

    def _forwarded(self, eqn: Any, i: int) -> int | None:
        """The input of `eqn` its output `i` copies, or None."""
        forwards = describe(eqn).forwards
        return None if forwards is None else forwards(eqn, i, self._position)

    def _position(self, body: Any, i: int) -> int | None:
        """Which input of `body` its output `i` copies, or None."""
        return self.of(body, body.outvars[i])


def _drop_copies(closed: Any, out_shape: Any, priors: list[list[int | None]]) -> tuple[Any, Any]:
    """`closed` and its output shape without the changes that copy a variable's
    own input: those an NNX transform (`nnx.jit`, `nnx.scan`, ...) handed back unchanged."""
    out, changes = out_shape
    if changes is None or not changes.paths:
        return closed, out_shape
    outvars = closed.jaxpr.outvars
    origins = _Origins()
    start = len(jax.tree_util.tree_leaves(out))
    used = [True] * start
    kept = []
    for variable, prior in zip(changes.variables, priors):
        n = len(jax.tree_util.tree_leaves(variable))
        mine = outvars[start : start + n]
        start += n
        same = len(prior) == n and all(
            p is not None and origins.of(closed.jaxpr, v) == p for v, p in zip(mine, prior)
        )
        kept.append(not same)
        used += [not same] * n
    used += [True] * (len(outvars) - start)  # the `Stateful` objects' states
    if all(kept):
        return closed, out_shape
    return _jax.prune_outputs(closed, used), (out, changes.keep(kept))


# ---------------------------------------------------------------------------
# Outputs that are not arrays.


class _Static:
    """A non-array leaf of a traced function's output (a string, a Python number,
    an object), held in the output's tree structure rather than as a traced value,
    so it reaches the caller as itself, as ``equinox.filter_jit`` returns it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Static)
            and type(self.value) is type(other.value)
            and (self.value is other.value or bool(self.value == other.value))
        )

    def __hash__(self) -> int:
        return 0  # compared by value only where two output structures meet


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda v, _: _Static(v))


def hide_static(out: Any) -> Any:
    """`out` with each non-array leaf wrapped so that tracing carries it as structure."""
    return jax.tree_util.tree_map(lambda leaf: leaf if is_array(leaf) else _Static(leaf), out)


def reveal_static(out: Any) -> Any:
    """`out` with the leaves `hide_static` wrapped given back as themselves.

    Args:
        out: a traced function's output, rebuilt from its output structure.

    Returns:
        The same pytree, each non-array leaf as the function returned it.
    """
    structure = jax.tree_util.tree_structure(out)
    try:
        if structure in _without_static:
            return out
    except Exception:  # auxiliary data that cannot be compared: looked at every time
        pass
    leaves, tree = jax.tree_util.tree_flatten(out, is_leaf=_is_static)
    if not any(map(_is_static, leaves)):
        try:
            _without_static[structure] = None
            if len(_without_static) > 256:
                _without_static.pop(next(iter(_without_static)))
        except Exception:
            pass
        return out
    return jax.tree_util.tree_unflatten(
        tree, [leaf.value if isinstance(leaf, _Static) else leaf for leaf in leaves]
    )


def _is_static(leaf: Any) -> bool:
    return isinstance(leaf, _Static)


# The output structures (as compiled walks give them) seen to hold no `_Static`, so
# that they hold none of the caller's values; the most recent last.
_without_static: dict[Any, None] = {}


# ---------------------------------------------------------------------------
# Tracing under the convention.


def make_jaxpr(f, args, kwargs, graph=None, return_shape=False):
    """`jax.make_jaxpr` of `f(*args, **kwargs)`, tracing only arrays.

    Array leaves are traced (so are `jax.ShapeDtypeStruct`s, so a function's
    sites can be found from shapes alone, and numbers in NNX state, which are
    data); everything else is closed over. NNX graph nodes in the arguments
    (and `f` itself, if it is one or a method of one) are split and merged
    (`graph` is given when the caller split them already). The traced function
    returns `(f's output, changed NNX state)`.
    Returns the closed jaxpr, the traced leaves in order, and, if
    `return_shape`, the traced function's output shape. Sows keep their effect
    while tracing, so dead-code elimination and partial evaluation (of `grad`,
    `scan`, ...) cannot drop a bare one.
    """
    if graph is None:
        (f, args, kwargs), graph, _ = split_nodes((f, args, kwargs))
    leaves, tree = jax.tree_util.tree_flatten((f, args, kwargs, graph))
    in_state = range(
        tree.num_leaves - (0 if graph is None else len(jax.tree_util.tree_leaves(graph))),
        tree.num_leaves,
    )
    positions = [
        i
        for i, leaf in enumerate(leaves)
        if is_array(leaf)
        or isinstance(leaf, jax.ShapeDtypeStruct)
        or (i in in_state and isinstance(leaf, numbers.Number))
    ]

    priors: list[
        list[int | None]
    ] = []  # per changed variable: the positions of its old value's leaves

    def flat_f(*arrays):
        filled = list(leaves)
        for i, a in zip(positions, arrays):
            filled[i] = a
        out, changes, before = call_merged(*jax.tree_util.tree_unflatten(tree, filled))
        at = {id(a): i for i, a in enumerate(arrays)}
        priors[:] = [[at.get(id(leaf)) for leaf in jax.tree_util.tree_leaves(b)] for b in before]
        return hide_static(out), changes

    # JAX's errors name the traced function: make it the user's, not `flat_f`.
    flat_f.__wrapped__ = inspect.unwrap(f)
    arrays = [leaves[i] for i in positions]
    try:
        with tracing_for_harvest():
            closed, out_shape = jax.make_jaxpr(flat_f, return_shape=True)(*arrays)
    except (  # `if x.sum() > 0`, `int(x)`, `np.asarray(x)`
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerIntegerConversionError,
        jax.errors.TracerArrayConversionError,
    ) as e:
        if hasattr(e, "add_note"):  # Python 3.11+
            e.add_note(_errors.traced_like_jit())
        raise
    closed, out_shape = _drop_copies(closed, out_shape, priors)
    if return_shape:
        return closed, arrays, out_shape
    return closed, arrays


# ---------------------------------------------------------------------------
# The compile-cache key of what is not traced, and what a function closes over.


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
        return _Same(value)
    return key


class _Same:
    """A value in a key by identity (held, so its id is not reused while the key is kept)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and self.value is other.value

    def __hash__(self) -> int:
        return id(self.value)


class Held:
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
        return isinstance(other, Held) and self.value is other.value and self.key == other.key

    def __hash__(self) -> int:
        return self._hash


_EMPTY = Held(None)  # a cell not yet filled (a name assigned after the def)


def closure_of(fn: Any) -> tuple[Any, ...]:
    """What ``fn`` closes over, one entry per cell: arrays, NNX graph nodes (to be
    split, their state traced, as an argument's is), and containers (tuple,
    list, dict) of arrays and Python numbers, as themselves, so their arrays are
    traced and their numbers keyed; anything else ``Held`` (a list that ``fn``
    appends to stays the caller's list)."""
    cells = getattr(fn, "__closure__", None) or ()
    values = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:
            values.append(_EMPTY)
            continue
        values.append(value if _is_data(value) else Held(value))
    return tuple(values)


def _is_data(value: Any) -> bool:
    """Whether a value a function reads (not an argument) is taken apart, its arrays
    traced: an array, an NNX graph node, or a tuple, list or dict of arrays and
    Python numbers or strings (which are keyed)."""
    if type(value) not in (tuple, list, dict):
        return is_array(value) or _is_graph_node(value)
    leaves = jax.tree_util.tree_leaves(value)
    if all(type(leaf) in _IMMUTABLE for leaf in leaves):
        return False  # a config of numbers and strings, told without the array checks
    return any(map(is_array, leaves)) and all(
        is_array(leaf) or isinstance(leaf, (numbers.Number, str)) for leaf in leaves
    )


def _is_graph_node(value: Any) -> bool:
    kind = type(value)
    if kind in _NEVER_NODES or kind in _ARRAY_TYPES:
        return False  # the common leaves, told apart without NNX's checks (~5 µs each)
    registered = _registered()
    known = _node_types.get(kind)
    if known is not None and _node_types_registered[0] == registered:
        return known
    nnx = _nnx()
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


_NEVER_NODES = frozenset(
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


def with_closure(fn: Any, values: tuple[Any, ...], reads: tuple[tuple[str, Any], ...] = ()) -> Any:
    """``fn`` closing over ``values`` (as ``closure_of`` gave them, their arrays
    perhaps now tracers, their NNX nodes merged copies) instead of its own
    cells, and reading the NNX nodes among ``reads`` (as ``globals_read`` gave
    them) in place of its module's; ``fn`` itself if there is nothing to
    replace, so that its ``nonlocal`` and ``global`` writes still reach their targets."""
    nodes = {name: v for name, v in reads if not isinstance(v, Held)}
    own_cells = all(isinstance(v, Held) for v in values)
    if own_cells and not nodes:
        return fn
    cells = (
        fn.__closure__
        if own_cells
        else tuple(
            types.CellType()
            if v is _EMPTY
            else types.CellType(v.value if isinstance(v, Held) else v)
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
    arrays nor nodes (by its items: see ``static_key``) are ``Held`` for the
    compile-cache key, so rebinding or mutating one re-traces, as calling
    ``fn`` would see the new value. A larger NumPy array and a container of
    arrays are taken as themselves and traced, as closed-over ones are; each graph node
    as itself, to be split as an argument is, so a weight changed in place or
    a layer replaced is seen. Mutable defaults (a dict, a NumPy array) are
    ``Held`` too, under the names ``"<defaults>"`` and ``"<kwdefaults>"``."""
    code = getattr(fn, "__code__", None)
    space = getattr(fn, "__globals__", None)
    if code is None or space is None:
        return ()
    read = []
    for name in code.co_names:
        value = space.get(name, _UNBOUND)
        if type(value) in _NOT_READ:  # the functions, modules and classes a body calls
            continue
        if _is_graph_node(value) or _is_large_numpy(value) or _is_data_container(value):
            read.append((name, value))  # traced, read afresh at every call
        elif type(value) in _CONFIGS or is_array(value) or isinstance(value, (numbers.Number, str)):
            read.append((name, Held(value)))
        elif value is not _UNBOUND:
            # Any other object (an enum, a frozen config, a Linen model): a mutable
            # config object by its attributes too, a callable or a value-hashed one by
            # identity (it cannot change, or its hash would cost a call more than its key).
            by_attributes = type(value).__hash__ is object.__hash__ and not callable(value)  # type: ignore[comparison-overlap]
            read.append((name, Held(value, keyed=by_attributes)))
    # Defaults a call leaves out are read when it is traced: a mutable one (a config
    # dict, a NumPy array) is keyed as a module-level value, under a name no global has.
    for name, defaults in (
        ("<defaults>", getattr(fn, "__defaults__", None)),
        ("<kwdefaults>", getattr(fn, "__kwdefaults__", None)),
    ):
        values = defaults.values() if isinstance(defaults, dict) else defaults or ()
        if not all(type(v) in _IMMUTABLE for v in values):
            read.append((name, Held(defaults)))
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
