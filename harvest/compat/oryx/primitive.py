"""The parts of oryx.core.primitive that probabilistic programs use.

`FlatPrimitive(name)` is a multiple-results primitive defined by its
implementation alone: abstract evaluation, JVP, batching and lowering all
come from tracing `impl`, so `def_impl` is all a user writes (a
`def_abstract_eval` may still override the shapes). `tie_all`/`tie_in` are
identities that make the result depend on other values.

Example:
    >>> import jax
    >>> from harvest.compat.oryx import primitive
    >>> twice_p = primitive.FlatPrimitive("twice")
    >>> _ = twice_p.def_impl(lambda x: [2.0 * x])
    >>> jax.jit(lambda x: twice_p.bind(x)[0])(3.0)
    Array(6., dtype=float32)
    >>> jax.grad(lambda x: twice_p.bind(x)[0])(3.0)
    Array(2., dtype=float32, weak_type=True)
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from ... import _jax
from ..._typing import T

__all__ = ["FlatPrimitive", "tie_all", "tie_in"]


class FlatPrimitive(_jax.Primitive):
    """A primitive whose every rule is derived from its implementation.

    Args:
        name: the primitive's name, as jaxprs print it.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.multiple_results = True
        self.def_abstract_eval(self._abstract)
        _jax.jvp_rules[self] = self._jvp
        _jax.plain_batching_rules[self] = self._batch
        _jax.register_lowering(self, _jax.lower_fun(self._call_impl, multiple_results=True))

    def _call_impl(self, *args: Any, **params: Any) -> Any:
        return self.impl(*args, **params)

    def _abstract(self, *avals: Any, **params: Any) -> list[Any]:
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        outs = jax.eval_shape(functools.partial(self.impl, **params), *specs)
        return [jax.core.ShapedArray(o.shape, o.dtype) for o in outs]

    def _jvp(self, primals: Any, tangents: Any, **params: Any) -> Any:
        tangents = [_jax.instantiate_zeros(t) for t in tangents]
        return jax.jvp(lambda *p: list(self.impl(*p, **params)), list(primals), tangents)

    def _batch(self, args: Any, dims: Any, **params: Any) -> tuple[Any, list[int]]:
        outs = jax.vmap(lambda *a: list(self.impl(*a, **params)), in_axes=list(dims))(*args)
        return outs, [0] * len(outs)


def tie_all(*args: T) -> tuple[T, ...]:
    """Returns ``args`` unchanged (oryx ties them together in the trace; harvest needs no tie).

    Args:
        *args: the values to tie.

    Returns:
        ``args``, as a tuple.

    Example:
        >>> from harvest.compat.oryx import primitive
        >>> primitive.tie_all(1.0, 2.0)
        (1.0, 2.0)
    """
    return args


def tie_in(x: Any, y: T) -> T:
    """Returns ``y`` (oryx's stand-in for the removed ``jax.tie_in``).

    Args:
        x: the value ``y`` would have been tied to (unused).
        y: the value to return.

    Returns:
        ``y``.

    Example:
        >>> from harvest.compat.oryx import primitive
        >>> primitive.tie_in(1.0, 2.0)
        2.0
    """
    del x
    return y
