"""`Steps`: what `reap(..., max_steps=N)` returns for a name sown inside a `while_loop`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Steps:
    """A bounded per-step record of a site inside a ``lax.while_loop``.

    A ``while_loop`` runs a number of iterations known only when it runs, so
    ``reap(f, max_steps=N)`` records each of the first ``N`` iterations into
    a buffer of fixed size and counts the iterations that ran. Iterations
    after the ``N``-th are counted but not recorded; rows for iterations that
    did not run are zeros. ``Steps`` is a pytree, so it comes out of
    ``jax.jit`` and ``jax.vmap`` like any array.

    Attributes:
        values: the reaped value, shaped as ``reap`` shapes a site inside a
            ``scan`` of ``N`` iterations: ``[N * k, *shape]`` for ``append``
            and ``instrument``'s sites (``k`` occurrences per iteration,
            usually one), a tuple of ``[N, *shape]`` entries for ``collect``.
        count: the number of iterations the loop ran (an ``int32`` array);
            ``count > N`` means the record was truncated to the first ``N``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest import sow, reap
        >>> def f(x):
        ...     def body(c):
        ...         return sow(c * 2.0, name="c", mode="append")
        ...     return jax.lax.while_loop(lambda c: c < 10.0, body, x)
        >>> steps = reap(f, max_steps=8)(1.0)["c"]
        >>> int(steps.count), steps.values[: int(steps.count)]
        (4, Array([ 2.,  4.,  8., 16.], dtype=float32))
    """

    values: Any
    count: Any


jax.tree_util.register_dataclass(Steps, data_fields=["values", "count"], meta_fields=[])
