"""The calling convention of every harvest transformation: arrays traced, the rest static.

As with `equinox.filter_jit`, the JAX and NumPy arrays among a call's
arguments are traced, and every other leaf -- a Python number, bool, None,
string, callable, enum, a config object -- reaches the function as itself.
So `range(n)` and `if training:` work inside a harvested function, and a
different Python value means a different trace (it is part of the compile
cache key).
"""

from __future__ import annotations

import jax
import numpy as np

from ._primitive import tracing_for_harvest


def is_array(leaf):
    """Whether a leaf of the arguments is traced (a JAX or NumPy array, or a tracer)."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def make_jaxpr(f, args, kwargs, return_shape=False):
    """`jax.make_jaxpr` of `f(*args, **kwargs)`, tracing only the array leaves.

    `jax.ShapeDtypeStruct` leaves are traced too, so a function's sites can be
    found from shapes alone. Returns the closed jaxpr, whose inputs are the
    traced leaves in order, those leaves, and (if `return_shape`) the output's
    shape. Sows keep their effect while tracing, so dead-code elimination and
    partial evaluation (of `grad`, `scan`, ...) cannot drop a bare one.
    """
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)]

    def flat_f(*arrays):
        filled = list(leaves)
        for i, a in zip(positions, arrays):
            filled[i] = a
        a, k = jax.tree_util.tree_unflatten(tree, filled)
        return f(*a, **k)

    arrays = [leaves[i] for i in positions]
    with tracing_for_harvest():
        traced = jax.make_jaxpr(flat_f, return_shape=return_shape)(*arrays)
    if return_shape:
        closed, out_shape = traced
        return closed, arrays, out_shape
    return traced, arrays
