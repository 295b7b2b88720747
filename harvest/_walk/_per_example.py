"""Under vmap, an intervention sees one example, as the function sowing it does.

A sow inside `jax.vmap` files the batched value, its vmap axes leading. A
planted callable is applied to each example, vmapped over those axes, as `f`
written with the callable inline would apply it. Two optional attributes of
the planted object let it say more:

  per_example = False
      It is handed the whole batch, vmap axes leading (`stream`'s tap, which
      re-emits the batched sow).
  for_one_example(old) -> (callable, in_axes or None)
      It holds data with one value per example (a clean run's activations, a
      mask along a batch axis): the callable for one example of the vmap axis
      leading `old`, and `jax.vmap`'s in_axes for it (a prefix of its pytree),
      mapping those leaves along that axis. Without it, or with None for
      in_axes, every example shares the callable as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def applied_per_example(
    fn: Any, old: Any, index: Any, batch: int, call: Callable[[Any, Any, Any, int], Any]
) -> Any:
    """``call(fn, old, index, 0)`` applied to each example of the ``batch`` vmap
    axes leading every leaf of ``old``, as ``f`` vmapped would apply ``fn``; for
    a callable that opts out, ``call(fn, old, index, batch)``, the last argument
    saying how many vmap axes lead the ``old`` it is given.

    ``index`` (None for a callable of the old value alone) is the occurrence
    index: one for every example, or, counted by a ``while_loop`` whose
    predicate vmap batches, one per example along the outermost vmap axes.
    """
    if not batch or getattr(fn, "per_example", True) is False:
        return call(fn, old, index, batch)
    one, axes = one_example(fn, old)
    index_axis = 0 if index is not None and jnp.ndim(index) else None

    # What is not mapped is closed over, not passed: a callable need not be a pytree.
    args = [old] + [one] * (axes is not None) + [index] * (index_axis is not None)
    in_axes = (0, *[axes] * (axes is not None), *[index_axis] * (index_axis is not None))

    def each(o: Any, *rest: Any) -> Any:
        it = iter(rest)
        f = next(it) if axes is not None else one
        i = next(it) if index_axis is not None else index
        return applied_per_example(f, o, i, batch - 1, call)

    return jax.vmap(each, in_axes=in_axes)(*args)


def one_example(fn: Any, old: Any) -> tuple[Any, Any]:
    """``fn`` for one example of the vmap axis leading ``old``, and vmap's in_axes
    for it (None: shared by every example); see ``for_one_example`` above."""
    split = getattr(fn, "for_one_example", None)
    return split(old) if callable(split) else (fn, None)
