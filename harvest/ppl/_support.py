"""Observed values outside their distribution's support, found before sampling.

TFP's densities are formulas: `Exponential(1).log_prob(-2.0)` is finite, so an
observation outside the support would be scored and a posterior returned.
`sample_posterior` runs the program once with the observed values planted and
the support-checking switch of `_tags.py` on; each draw then sows, under
`OUTSIDE_SUPPORT`, a boolean per independent element (its sample and batch
axes) saying whether its value is outside the support:

* a continuous draw is outside where its default event-space bijector's
  inverse is NaN (softplus, exp and sigmoid have no preimage there) or maps
  back to another point (a vector off the simplex);
* a discrete draw is checked against the support of its kind (`Bernoulli`,
  `Categorical`, `Poisson`, `Geometric`, `Binomial`, `NegativeBinomial`):
  an integer in range. Other discrete kinds are not checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._calling._transforms import harvest_tags
from .._typing import Reaped, SowMode
from .._walk._sow import sow
from ._names import at_paths, check_drawn, leaf_paths
from ._tags import OUTSIDE_SUPPORT, RANDOM_VARIABLE, checking_support

# Relative distance beyond which a value mapped into R^n and back is another point.
ROUND_TRIP_TOLERANCE = 1e-3


def _whole(value: Any) -> Any:
    return value == jnp.round(value)


def _discrete(dist: Any, value: Any) -> Any:
    """Where `value` is inside the support of a discrete `dist`; None for unknown kinds."""
    kind = type(dist).__name__
    if kind == "Bernoulli":
        return (value == 0) | (value == 1)
    if kind == "Categorical":
        size = dist.probs_parameter().shape[-1]
        return _whole(value) & (value >= 0) & (value < size)
    if kind in ("Poisson", "Geometric", "NegativeBinomial"):
        return _whole(value) & (value >= 0)
    if kind == "Binomial":
        return _whole(value) & (value >= 0) & (value <= dist.total_count)
    return None


def outside(dist: Any, value: Any) -> jax.Array:
    """Booleans saying which elements of `value` lie outside the support: one per element
    where the support is elementwise, else one per independent event (sample, batch axes)."""
    event_rank = len(dist.event_shape)
    value = jnp.asarray(value)
    lead = value.shape[: value.ndim - event_rank]
    try:
        bijector = dist.experimental_default_event_space_bijector()
    except (AttributeError, NotImplementedError):
        return jnp.zeros(lead, bool)
    if bijector is None:
        inside = _discrete(dist, value)
        return jnp.zeros(lead, bool) if inside is None else ~jnp.asarray(inside)
    x = value.astype(jnp.result_type(float, value.dtype))
    u = bijector.inverse(x)
    back = bijector.forward(jnp.array(u, copy=True))  # a new array: TFP caches by identity
    far = (jnp.abs(back - x) > ROUND_TRIP_TOLERANCE * (1.0 + jnp.abs(x))) & jnp.isfinite(back)
    if u.shape == x.shape:  # an elementwise map: each element is checked on its own
        return jnp.isnan(u) | far
    u_rank = len(bijector.inverse_event_shape(dist.event_shape))
    bad_u = jnp.any(jnp.isnan(u), axis=tuple(range(u.ndim - u_rank, u.ndim)))
    far = jnp.any(far, axis=tuple(range(far.ndim - event_rank, far.ndim)))
    return jnp.broadcast_to(bad_u | far, lead)


def sow_outside(dist: Any, value: Any, name: str, mode: SowMode) -> None:
    """Files where the draw `name`'s value lies outside the support (while checking)."""
    sow(outside(dist, value), tag=OUTSIDE_SUPPORT, name=name, mode=mode)


def check_observed_support(
    f: Callable[..., Any], observed: Reaped, key: Any, args: Any, kwargs: Any
) -> None:
    """Raises, naming the site and the first index, if an observed value is outside the
    support of its distribution. Observations traced by the caller's jit are skipped."""
    names = leaf_paths(observed)
    if not names or any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(observed)):
        return

    def run(key: Any, observed: Reaped) -> Reaped:
        with checking_support():
            found: Reaped = harvest_tags(f, (RANDOM_VARIABLE, OUTSIDE_SUPPORT))(
                {RANDOM_VARIABLE: observed}, key, *args, **kwargs
            )[1].get(OUTSIDE_SUPPORT, {})
        return found

    try:
        found = jax.jit(run)(key, observed)
    except KeyError:  # a name that is no random variable: say so in the program's terms
        check_drawn("sample_posterior", f, names, (key, *args), kwargs)
        raise
    for name in names:
        flags = at_paths(found, {name})
        if not flags:
            continue
        bad = np.asarray(flags[0])
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"sample_posterior: the observed value of {name!r} has {int(bad.sum())} element(s) of {bad.size} "
                f"outside the support of its distribution (the first at index {first}). TFP may "
                "still give such a value a finite density, so the posterior would be silently wrong. "
                "Correct the data, or draw the site from a distribution whose support holds it."
            )
