"""Which variables a call really changed: decided on the jaxpr."""

from __future__ import annotations

from typing import Any

import jax

from .. import _jax
from .._walk._higher_order import describe


class _Origins:
    """Which input of a jaxpr each of its variables merely is. NNX transforms
    (`jit`, `remat`, `scan`, `while`, `cond`) hand every variable of the module back
    as a new output, the same value when the body returns the input unchanged:
    followed into the body, such an output leads to the input it copies."""

    def __init__(self) -> None:
        # id(jaxpr) -> (the equation making each variable, the place of each input by id)
        self._index: dict[int, tuple[dict[Any, Any], dict[int, int]]] = {}

    def of(self, jaxpr: Any, var: Any) -> int | None:
        """The place of the input of `jaxpr` that `var` is a copy of, or None if it is computed."""
        index = self._index.get(id(jaxpr))
        if index is None:
            made = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
            index = self._index[id(jaxpr)] = (made, {id(v): k for k, v in enumerate(jaxpr.invars)})
        made, inputs = index
        while not isinstance(var, _jax.Literal):
            if id(var) in inputs:
                return inputs[id(var)]
            eqn = made.get(var)
            if eqn is None:
                return None
            forwards = describe(eqn).forwards  # which input of `eqn` an output copies, if any
            k = None if forwards is None else forwards(eqn, eqn.outvars.index(var), self._position)
            if k is None:
                return None
            var = eqn.invars[k]
        return None

    def _position(self, body: Any, i: int) -> int | None:
        """Which input of `body` its output `i` copies, or None."""
        return self.of(body, body.outvars[i])


def drop_copies(closed: Any, out_shape: Any, priors: list[list[int | None]]) -> tuple[Any, Any]:
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
