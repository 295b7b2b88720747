"""The calling convention of every harvest transformation: arrays traced, the rest static.

As with `equinox.filter_jit`, the JAX and NumPy arrays among a call's arguments
are traced, and every other leaf (a Python number, bool, string, callable, config)
reaches the function as itself, part of the compile cache key: `range(n)` and
`if training:` work inside a harvested function.

Flax NNX graph nodes among the arguments, or bound as `self`, are split as
`nnx.jit` splits them, their state's arrays traced, and merged inside the trace
into fresh objects the function may mutate (batch statistics, RNG counters,
`Module.sow`); the variables it changed or added come out as data and are written
back afterwards, so a harvested call leaves a module as a direct call would.
"""

from __future__ import annotations

import inspect
import numbers

import jax

from .._walk._leaves import hide_static, is_array
from .._walk._primitive import tracing_for_harvest
from ._copies import drop_copies
from ._nnx_state import call_merged, split_nodes


def make_jaxpr(f, args, kwargs, graph=None, return_shape=False):
    """`jax.make_jaxpr` of `f(*args, **kwargs)`, tracing only arrays.

    Array leaves are traced (so are `jax.ShapeDtypeStruct`s, so that sites can be
    found from shapes alone, and numbers in NNX state, which are data); the rest is
    closed over. NNX graph nodes in the arguments and `f` are split and merged
    (`graph` is given when the caller split them already). Returns the closed jaxpr
    of `(f's output, changed NNX state)`, the traced leaves in order, and, if
    `return_shape`, that output's shape. Sows keep their effect while tracing, so
    dead-code elimination and partial evaluation cannot drop a bare one.
    """
    if graph is None:
        (f, args, kwargs), graph, _ = split_nodes((f, args, kwargs))
    leaves, tree = jax.tree_util.tree_flatten((f, args, kwargs, graph))
    state_from = tree.num_leaves - len(jax.tree_util.tree_leaves(graph))  # None has no leaves
    positions = [
        i
        for i, leaf in enumerate(leaves)
        if is_array(leaf)
        or isinstance(leaf, jax.ShapeDtypeStruct)
        or (i >= state_from and isinstance(leaf, numbers.Number))
    ]

    priors: list[list[int | None]] = []  # per changed variable: its old value's leaves' positions

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
            e.add_note(
                "harvest traces the function, as jax.jit does: its arrays are tracers, so Python "
                "control flow on their values (if x.sum() > 0, int(x)) fails as it would under "
                "jit. Use jnp.where / lax.cond, or pass such values as Python numbers (they are "
                "static)."
            )
        raise
    closed, out_shape = drop_copies(closed, out_shape, priors)
    return (closed, arrays, out_shape) if return_shape else (closed, arrays)
