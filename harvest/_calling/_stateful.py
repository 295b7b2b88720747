"""Objects holding state of their own (an instrumented Penzai model's
`pz.StateVariable`s): flattened, they give the state's values, which are
traced; the copy inside the trace updates its own; its state after the call
is an output, given to the caller's object afterwards."""

from __future__ import annotations

import contextvars
import inspect
from typing import Any

import jax

from .._walk._leaves import ARRAY_TYPES, NEVER_NODES, is_graph_node


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


class flattening_call:  # noqa: N801  (used as a context manager, like a function)
    """While harvest flattens one call's parts: a `Stateful` object may flatten to
    a form that is cheaper to flatten again (an instrumented Penzai model gives its
    arrays as direct children), which only harvest's own walk unflattens."""

    __slots__ = ("token",)

    def __enter__(self) -> None:
        self.token = _flattening_call.set(True)

    def __exit__(self, *exc: object) -> None:
        _flattening_call.reset(self.token)


def in_flattening_call() -> bool:
    return _flattening_call.get()


def stateful_objects(tree: Any) -> tuple[Stateful, ...]:
    """The `Stateful` objects in `tree`, in flattening order (not looking inside NNX
    graph nodes, which hold none and can be large)."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=has_state_of_its_own)
    return tuple(x for x in leaves if isinstance(x, Stateful))


def has_state_of_its_own(x: Any) -> bool:
    """A `Stateful` object, an NNX graph node or a bound method of either."""
    if type(x) in NEVER_NODES or type(x) in ARRAY_TYPES:
        return False  # the common nodes and leaves, without the ABC and NNX checks
    if inspect.ismethod(x):
        x = x.__self__
    return isinstance(x, Stateful) or is_graph_node(x)


def held_states(tree: Any) -> tuple[Any, ...]:
    """The state of each `Stateful` object in `tree` (in `stateful_objects`'s order),
    or () if none holds any."""
    states = tuple(obj.harvest_state() for obj in stateful_objects(tree))
    return states if any(s is not None for s in states) else ()
