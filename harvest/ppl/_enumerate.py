"""Discrete latents summed out by enumeration, so the scores are of the continuous rest.

A draw made with `random_variable(..., enumerate=True)` (a `Bernoulli` or a
`Categorical`, whose number of categories is static) also sows, under
`ENUMERATED`, a marker shaped `batch shape + (number of categories,)`. When a
score (`joint_log_prob`, `unconstrained`) finds such a draw without a value,
it computes the program's densities once per value of the support, all at
once under `vmap`, and sums the draw out with a log-sum-exp:

* scalar enumerated draws (any number of them) are enumerated jointly, over
  the product of their supports;
* one enumerated draw per step of a `lax.scan` (`mode="append"`) is summed
  out by a forward pass over the steps, linear in the scan's length
  (`_markov.py`);
* one enumerated draw with a batch shape `B` (a per-point assignment, as in a
  mixture) is enumerated element by element: the elements are independent
  draws, each density of shape `B` is taken as the factor of the matching
  element (the mixture's likelihood), and a density of any other shape must
  not depend on the draw: the sum would not factor by element, so that is an
  error naming the density (found while tracing, by `vmap` over the support:
  such a density comes out batched). A density of shape `B` is taken to
  depend on element `i` of the draw alone; that is the model's promise, as
  for NumPyro's enumeration inside a plate.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._typing import Reaped, SowMode
from .._walk._sow import sow
from . import _errors
from ._markov import backward_sample, chain_factors, forward
from ._names import density_leaves, leaf_paths, nested
from ._tags import ENUMERATED, ENUMERATED_IN_SCAN

ENUMERABLE = ("Bernoulli", "Categorical")
# The joint support of scalar enumerated draws is enumerated at once; beyond this many
# assignments, a model should marginalise by hand.
MAX_ASSIGNMENTS = 4096


def sow_support(dist: Any, name: str, mode: SowMode = "strict") -> None:
    """Files the marker of an enumerated draw: shape `batch shape + (support size,)`. A
    draw in a scan (`mode="append"`) files it under `ENUMERATED_IN_SCAN` too, stacked
    over the steps: that draw is summed out by a forward pass (`_markov.py`)."""
    size = 2 if type(dist).__name__ == "Bernoulli" else dist.probs_parameter().shape[-1]
    marker = jnp.zeros((*dist.batch_shape, size), dist.dtype)  # carries the draw's dtype
    sow(marker, tag=ENUMERATED, name=name, mode=mode)
    if mode == "append":
        sow(marker, tag=ENUMERATED_IN_SCAN, name=name, mode=mode)


class Support(NamedTuple):
    size: int
    batch: tuple[int, ...]
    dtype: Any
    in_scan: bool = False


def supports(markers: Reaped, names: set[str], in_scan: Reaped | None = None) -> dict[str, Support]:
    """`{name: Support}` for the enumerated draws among `names`; `in_scan`: the markers
    reaped from `ENUMERATED_IN_SCAN` (the draws made one per step of a scan)."""
    flat = dict(zip(leaf_paths(markers), jax.tree_util.tree_leaves(markers)))
    scanned = set(leaf_paths(in_scan or {}))
    return {
        n: Support(flat[n].shape[-1], tuple(flat[n].shape[:-1]), flat[n].dtype, n in scanned)
        for n in sorted(names & set(flat))
    }


def marginal(densities: Callable[[Reaped], Reaped], enumerated: dict[str, Support]) -> jax.Array:
    """The log of the sum, over every value of the `enumerated` draws, of the exp of
    the densities `densities(values of the enumerated draws)` (a reap of them)."""
    names = list(enumerated)
    if any(enumerated[n].in_scan for n in names):
        return chain_marginal(densities, enumerated)
    if not any(enumerated[n].batch for n in names):
        _, totals = _joint(densities, enumerated)
        return jax.nn.logsumexp(totals)
    aligned, rest = _by_element(densities, enumerated)
    return jnp.sum(jax.nn.logsumexp(aligned, axis=0)) + rest


def draw(
    densities: Callable[[Reaped], Reaped], enumerated: dict[str, Support], key: jax.Array
) -> Reaped:
    """Values of the `enumerated` draws from their conditional posterior, the densities
    `densities(values)` being their joint with everything else: exactly, over a joint
    enumeration or element by element; by forward filtering, backward sampling in a scan."""
    names = list(enumerated)
    if any(enumerated[n].in_scan for n in names):
        name = chain_name(enumerated)
        start, steps, _ = chain_factors(densities, name, enumerated[name])
        path = backward_sample(key, forward(start, steps), steps)
        return nested([name], [path.astype(enumerated[name].dtype)])
    if not any(enumerated[n].batch for n in names):
        assignments, totals = _joint(densities, enumerated)
        chosen = assignments[jax.random.categorical(key, totals)]
        return nested(names, [chosen[i].astype(enumerated[n].dtype) for i, n in enumerate(names)])
    aligned, _ = _by_element(densities, enumerated)
    name = names[0]
    values = jax.random.categorical(key, aligned, axis=0)
    return nested([name], [values.astype(enumerated[name].dtype)])


def _joint(
    densities: Callable[[Reaped], Reaped], enumerated: dict[str, Support]
) -> tuple[jax.Array, jax.Array]:
    """`(assignments [A, n], log joint [A])` over the product of scalar draws' supports."""
    names = list(enumerated)
    grid = list(itertools.product(*(range(enumerated[n].size) for n in names)))
    if len(grid) > MAX_ASSIGNMENTS:
        raise ValueError(
            f"enumerating {', '.join(names)} jointly takes {len(grid)} assignments (at most {MAX_ASSIGNMENTS}). "
            "Enumerate fewer draws, or marginalise some by hand."
        )
    assignments = jnp.asarray(grid, jnp.int32)

    def total(assignment: jax.Array) -> jax.Array:
        dtypes = [enumerated[n].dtype for n in names]
        values = nested(names, [a.astype(t) for a, t in zip(assignment, dtypes)])
        return sum((jnp.sum(d) for _, d in density_leaves(densities(values))), jnp.zeros(()))

    return assignments, jax.vmap(total)(assignments)


def _by_element(
    densities: Callable[[Reaped], Reaped], enumerated: dict[str, Support]
) -> tuple[jax.Array, jax.Array]:
    """`(aligned [K, *B], rest)`: each element's log factor at each value of one batched
    draw, and the densities that do not depend on it."""
    names = list(enumerated)
    if len(names) > 1:
        raise ValueError(
            f"cannot enumerate {', '.join(names)} together: one of them has a batch shape. "
            "Enumerate one batched draw (a per-point assignment) or any number of scalar ones."
        )
    name = names[0]
    size, batch, dtype, _ = enumerated[name]

    def per_value(k: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        found = density_leaves(densities(nested([name], [jnp.full(batch, k, dtype)])))
        aligned = sum((d for _, d in found if d.shape == batch), jnp.zeros(batch))
        return aligned, [jnp.sum(d) for _, d in found if d.shape != batch]

    values = jnp.arange(size)
    try:
        # `None`: the other densities must not vary with the draw's value.
        aligned, rest = jax.vmap(per_value, out_axes=(0, None))(values)
    except ValueError:
        varying = _varying(densities, name, batch, dtype, values)
        if not varying:
            raise  # an error of the model's own
        which = ", ".join(f"{n!r} (shape {shape})" for n, shape in varying)
        raise ValueError(
            f"cannot enumerate {name!r} element by element: its value changes the density of "
            f"{which}, which is not shaped like the draw's batch {batch}, so the sum over "
            f"{name!r} does not factor by element. Give that distribution the batch shape {batch} "
            "(e.g. tfd.Normal(loc, scale) rather than tfd.Independent(...)), or marginalise by hand."
        ) from None
    return aligned, sum(rest, jnp.zeros(()))


def _varying(
    densities: Callable[[Reaped], Reaped],
    name: str,
    batch: tuple[int, ...],
    dtype: Any,
    values: Any,
) -> list[tuple[str, tuple[int, ...]]]:
    """`(name, shape)` of the densities not shaped `batch` that vary with the draw `name`."""
    sites: list[tuple[str, tuple[int, ...]]] = []

    def others(k: jax.Array) -> list[jax.Array]:
        found = density_leaves(densities(nested([name], [jnp.full(batch, k, dtype)])))
        sites[:] = [(n, tuple(d.shape)) for n, d in found if d.shape != batch]
        return [d for _, d in found if d.shape != batch]

    jax.eval_shape(others, values[0])
    varying = []
    for i, site in enumerate(list(sites)):
        try:
            jax.vmap(lambda k, i=i: others(k)[i], out_axes=None)(values)
        except ValueError:
            varying.append(site)
    return varying


def chain_marginal(
    densities: Callable[[Reaped], Reaped], enumerated: dict[str, Support]
) -> jax.Array:
    """The marginal over a draw enumerated at each step of a scan (`_markov.py`)."""

    name = chain_name(enumerated)
    start, steps, rest = chain_factors(densities, name, enumerated[name])
    total: jax.Array = jax.nn.logsumexp(forward(start, steps)[-1]) + rest
    return total


def chain_name(enumerated: dict[str, Support]) -> str:
    """The one draw enumerated in a scan, or the error saying why there is not one."""
    names = list(enumerated)
    if len(names) > 1:
        raise _errors.enumeration_in_scan(names, "only one enumerated draw is summed out")
    name = names[0]
    if len(enumerated[name].batch) != 1:
        raise _errors.enumeration_in_scan(
            [name], f"each step draws a batch of shape {enumerated[name].batch[1:]}"
        )
    return name
