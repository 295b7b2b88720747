"""Each draw as a structural mechanism `value = forward(noise)`, for counterfactuals.

A counterfactual needs the exogenous noise of every draw, shared between the
factual and the counterfactual world. While the noise-explicit switch of
`_tags.py` is on, `random_variable` draws the noise (sown under `NOISE`),
computes the value from it, and sows under `ABDUCED` the noise that explains
the value actually taken (planted or not). These are the distributions with
a mechanism, and the noise each uses:

* location-scale families (`Normal`, `Laplace`, `Logistic`, `Cauchy`):
  `value = loc + scale * noise`, the noise standard (`Normal(0, 1)`, ...);
  the noise behind a value is `(value - loc) / scale`, exactly;
* `Bernoulli` and `Categorical`: `noise ~ Uniform(0, 1)` and the value is the
  quantile of the noise (`1` when `noise > 1 - p`; the category whose
  cumulative-probability interval holds the noise): monotone in the noise, the
  usual assumption under which counterfactuals of discrete variables are
  identified. The noise behind a value is not unique: it is drawn uniformly
  from that value's interval;
* any other continuous distribution of scalar events whose `quantile` TFP
  implements (`HalfNormal`, `Exponential`, `Gamma`, `Uniform`, ...): `value = quantile(noise)`,
  `noise ~ Uniform(0, 1)`, and `noise = cdf(value)`;
* `Independent` and `Sample` of any of these, element by element.

Anything else has no mechanism here, and a counterfactual of a program that
draws from it is an error naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._tfp_shim import import_tfp

tfd = import_tfp().distributions

LOCATION_SCALE = (tfd.Normal, tfd.Laplace, tfd.Logistic, tfd.Cauchy)


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """`noise(key, shape)`, `forward(noise) -> value`, `abduce(value, key) -> noise`."""

    noise: Callable[[Any, tuple[int, ...]], jax.Array]
    forward: Callable[[jax.Array], jax.Array]
    abduce: Callable[[jax.Array, Any], jax.Array]


def _uniform(key: Any, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.uniform(key, shape)


def _between(key: Any, lo: jax.Array, hi: jax.Array) -> jax.Array:
    return lo + (hi - lo) * jax.random.uniform(key, jnp.shape(lo))


def _bernoulli(dist: Any) -> Mechanism:
    p = dist.probs_parameter()

    def forward(noise: jax.Array) -> jax.Array:
        return jnp.asarray(noise > 1.0 - p).astype(dist.dtype)

    def abduce(value: jax.Array, key: Any) -> jax.Array:
        one = jnp.broadcast_to(value, jnp.broadcast_shapes(jnp.shape(value), jnp.shape(p))) > 0
        lo = jnp.where(one, 1.0 - p, 0.0)
        hi = jnp.where(one, 1.0, 1.0 - p)
        return _between(key, lo, hi)

    return Mechanism(_uniform, forward, abduce)


def _categorical(dist: Any) -> Mechanism:
    upper = jnp.cumsum(dist.probs_parameter(), axis=-1)
    lower = upper - dist.probs_parameter()

    def forward(noise: jax.Array) -> jax.Array:
        return jnp.sum(noise[..., None] > upper[..., :-1], axis=-1).astype(dist.dtype)

    def abduce(value: jax.Array, key: Any) -> jax.Array:
        k = value.astype(jnp.int32)[..., None]
        full = jnp.shape(value) + (upper.shape[-1],)
        lo = jnp.take_along_axis(jnp.broadcast_to(lower, full), k, axis=-1)[..., 0]
        hi = jnp.take_along_axis(jnp.broadcast_to(upper, full), k, axis=-1)[..., 0]
        return _between(key, lo, hi)

    return Mechanism(_uniform, forward, abduce)


def _location_scale(dist: Any) -> Mechanism:
    standard = type(dist)(jnp.zeros((), dist.dtype), jnp.ones((), dist.dtype))

    def noise(key: Any, shape: tuple[int, ...]) -> jax.Array:
        return jnp.asarray(standard.sample(shape, seed=key))

    def abduce(value: jax.Array, key: Any) -> jax.Array:
        return jnp.asarray((value - dist.loc) / dist.scale)

    return Mechanism(noise, lambda e: dist.loc + dist.scale * e, abduce)


def _no_mechanism(name: str, type_name: str) -> ValueError:
    return ValueError(
        f"counterfactual: the random variable {name!r} has a {type_name} distribution, which "
        "has no noise mechanism here (location-scale families, Bernoulli, Categorical, and "
        "continuous distributions with a quantile function have one). Fix it with intervene, "
        "or write it as loc + scale * noise with a standard noise draw."
    )


def _quantile(dist: Any, name: str) -> Mechanism:
    try:
        jax.eval_shape(dist.quantile, jnp.full(dist.batch_shape, 0.5, dist.dtype))
    except NotImplementedError as error:
        raise _no_mechanism(name, type(dist).__name__) from error
    return Mechanism(_uniform, dist.quantile, lambda value, key: dist.cdf(value))


def mechanism(dist: Any, name: str) -> Mechanism:
    """The mechanism by which `dist` turns noise into a value (see the module docstring)."""
    if isinstance(dist, (tfd.Independent, tfd.Sample)):
        return mechanism(dist.distribution, name)
    if isinstance(dist, LOCATION_SCALE):
        return _location_scale(dist)
    if isinstance(dist, tfd.Bernoulli):
        return _bernoulli(dist)
    if isinstance(dist, tfd.Categorical):
        return _categorical(dist)
    # The quantile coupling is a point abduction only for a continuous, scalar-event draw.
    if not jnp.issubdtype(dist.dtype, jnp.floating) or tuple(dist.event_shape) != ():
        raise _no_mechanism(name, type(dist).__name__)
    return _quantile(dist, name)
