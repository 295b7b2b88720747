"""`random_variable`: a named draw that the ppl transformations can find.

A draw leaves two sows behind. Its sample is sown under `RANDOM_VARIABLE`
(so `joint_sample` reaps it and `intervene` plants it), and, for a
distribution, the pair `(log density, value)` — the density computed from the
value after that sow, so from the planted value when there is one — under
`LOG_DENSITY`, where `joint_log_prob` reaps it. The value rides along so that
`log_prob`'s inverse walk knows which variable each density scores. Both
sows share the draw's name. The density is sown in mode "collect" whatever
the draw's mode: densities are only summed, and "collect" keeps every
occurrence in and out of loops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Literal, overload

import jax
import jax.numpy as jnp

from .._typing import P, R, SowMode, T
from .._walk._modes import APPEND, STRICT
from .._walk._sow import sow
from . import _errors
from ._enumerate import ENUMERABLE, sow_support
from ._mechanisms import mechanism
from ._support import sow_outside
from ._tags import (
    ABDUCED,
    DETERMINISTIC,
    JACOBIAN,
    NOISE,
    RANDOM_VARIABLE,
    UNCONSTRAINED,
    is_checking_support,
    is_noise_explicit,
    is_scoring,
    is_unconstraining,
    sow_density,
)
from ._tfp_traces import fact, log_prob, onto_support

# "strict": one draw per name (the default, as in oryx). "append": one draw per
# loop iteration, stacked on a leading axis, for random variables in a scan.
RV_MODES = (STRICT.name, APPEND.name)


def is_distribution(obj: object) -> bool:
    """Duck-types a TFP distribution, so plain samplers work without TFP."""
    return callable(getattr(obj, "sample", None)) and callable(getattr(obj, "log_prob", None))


def _check_arguments(dist: object, name: object, mode: object) -> str:
    """The validated name."""
    if name is None:
        raise TypeError(
            "random_variable needs a name, e.g. random_variable(dist, name='x'): "
            "joint_sample, joint_log_prob, intervene and conditional refer to the draw by it."
        )
    if not isinstance(name, str) or not name:
        raise _errors.bad_name("random_variable", name)
    if mode not in RV_MODES:
        raise ValueError(
            f"random_variable(name={name!r}): mode {mode!r} is not supported. Use 'strict' "
            "for one draw, or 'append' for a draw inside lax.scan (draws stack on a "
            "leading axis)."
        )
    if is_distribution(dist) and type(dist).__module__.startswith("numpyro."):
        raise TypeError(
            f"random_variable(name={name!r}) got NumPyro's {type(dist).__name__}; harvest.ppl draws from "
            "TensorFlow Probability distributions (tensorflow_probability.substrates.jax), "
            f"e.g. tfd.{type(dist).__name__}(...), or from a sampling function key -> value."
        )
    if not (is_distribution(dist) or callable(dist)):
        raise TypeError(
            f"random_variable(name={name!r}) takes a TFP distribution (from "
            "tensorflow_probability.substrates.jax) or a sampling function key -> value; "
            f"got a {type(dist).__name__}."
        )
    return name


@overload
def random_variable(
    dist: Callable[Concatenate[Any, P], R],
    *,
    name: str,
    mode: Literal["strict", "append"] = "strict",
    enumerate: bool = False,  # noqa: A002 (NumPyro's word for it)
) -> Callable[Concatenate[Any, P], R]: ...
@overload
def random_variable(
    dist: Any,
    *,
    name: str,
    mode: Literal["strict", "append"] = "strict",
    enumerate: bool = False,  # noqa: A002
) -> Callable[[Any], Any]: ...
def random_variable(
    dist: Any,
    *,
    name: str | None = None,
    mode: Literal["strict", "append"] = "strict",
    enumerate: bool = False,  # noqa: A002
) -> Callable[..., Any]:
    """Returns a sampler `key -> value` that draws from `dist` as the random variable `name`.

    `dist` is a TFP distribution, whose log density `joint_log_prob` sums over
    all of the sample's axes (a batch of independent draws is one variable), or
    a plain sampling function `key -> value` (extra arguments are passed on),
    which has no density: such a variable can be sampled, intervened on and
    conditioned on, but not scored.

    `mode="strict"` (the default) allows one draw of `name` per program. Inside
    `lax.scan` use `mode="append"`: `joint_sample` stacks the draws on a
    leading axis, one row per iteration, and values are planted the same way.

    `enumerate=True` (a `Bernoulli` or `Categorical` draw) marks the draw to be
    summed out: `joint_log_prob` and `unconstrained` score the program without
    a value for it, marginalising it over its support (see `_enumerate.py`),
    so gradient-based samplers run on the continuous rest.

    Args:
        dist: a TFP distribution, or a sampling function ``key -> value``.
        name: the random variable's name (required), by which the transformations find it.
        mode: ``"strict"`` (one draw per program) or ``"append"`` (one per ``scan`` step).
        enumerate: whether to sum the (``Bernoulli`` or ``Categorical``) draw out when scoring.

    Returns:
        The sampler ``key -> value`` (with ``*args`` passed on to a sampling function).

    Raises:
        TypeError: if ``name`` is missing or not a string, ``dist`` is neither a
            distribution nor callable (or is a NumPyro distribution), or ``enumerate``
            is asked of a distribution that is not ``Bernoulli`` or ``Categorical``.
        ValueError: if ``mode`` is not ``"strict"`` or ``"append"``.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def model(key):
        ...     k1, k2 = jax.random.split(key)
        ...     z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
        ...     return ppl.random_variable(tfd.Normal(z, 0.5), name="x")(k2)
        >>> sorted(ppl.joint_sample(model)(jax.random.key(0)))
        ['x', 'z']
        >>> coin = ppl.random_variable(lambda key: jax.random.bernoulli(key), name="coin")
        >>> coin(jax.random.key(1)).dtype
        dtype('bool')
    """
    name = _check_arguments(dist, name, mode)
    if enumerate and type(dist).__name__ not in ENUMERABLE:
        raise TypeError(
            f"random_variable(name={name!r}, enumerate=True) sums the draw out over its support, "
            f"which needs a Bernoulli or Categorical distribution; got a {type(dist).__name__}."
        )
    if is_distribution(dist):

        def sample_distribution(key: Any) -> Any:
            if is_noise_explicit():
                return _from_noise(dist, key, name, mode)
            sample = _through_unconstrained(dist, key, name, mode)
            value = sow(sample, tag=RANDOM_VARIABLE, name=name, mode=mode)
            if enumerate:
                sow_support(dist, name, mode)
            if is_checking_support():
                sow_outside(dist, value, name, mode)
            sow_density(log_prob(dist, value), value, name)
            return value

        return sample_distribution

    def sample_function(key: Any, *args: Any, **kwargs: Any) -> Any:
        return sow(dist(key, *args, **kwargs), tag=RANDOM_VARIABLE, name=name, mode=mode)

    return sample_function


def _through_unconstrained(dist: Any, key: Any, name: str, mode: SowMode) -> Any:
    """The draw, made through `u` (sown under `UNCONSTRAINED`) while unconstraining.

    Every continuous draw goes through `u` and files its log-Jacobian: whether
    the draw stays free (or is fixed by `observed`, `intervene`,
    `conditional`) is known only to `unconstrained`, which plants `u` for the
    free draws and counts their Jacobians alone. A discrete draw has no
    bijector and is drawn as it is. While scoring, zeros of the sample's shape
    (or of `u`'s) stand in for the sample, so TFP's sampler is never traced.
    """
    shape = fact("sample shape", dist, _sample_shape) if is_scoring() else None
    if not (is_unconstraining() and fact("has a bijector", dist, _has_bijector)):
        return dist.sample(seed=key) if shape is None else jnp.zeros(*shape)
    u_shape = fact("u shape", dist, _unconstrained_shape) if shape is not None else None
    if u_shape is None:
        u = dist.experimental_default_event_space_bijector().inverse(dist.sample(seed=key))
    else:
        u = jnp.zeros(*u_shape)
    u = sow(u, tag=UNCONSTRAINED, name=name, mode=mode)
    value, log_det = onto_support(dist, u)
    sow(log_det, tag=JACOBIAN, name=name, mode="collect")
    return value


def _has_bijector(dist: Any) -> bool:
    return dist.experimental_default_event_space_bijector() is not None


def _sample_shape(dist: Any) -> tuple[tuple[int, ...], Any] | None:
    """`(shape, dtype)` of `dist.sample()` as TFP states it, or None where it does not
    (a structured or dynamic event, a distribution-like object that is not TFP's)."""
    try:
        batch, event = dist.batch_shape, dist.event_shape
        if not (batch.is_fully_defined() and event.is_fully_defined()):
            return None
        return (*batch, *event), jax.dtypes.canonicalize_dtype(dist.dtype)
    except (AttributeError, TypeError, ValueError):
        return None


def _unconstrained_shape(dist: Any) -> tuple[tuple[int, ...], Any] | None:
    """`(shape, dtype)` of `u`: the bijector may change the event's shape (a simplex)."""
    try:
        bijector = dist.experimental_default_event_space_bijector()
        event = bijector.inverse_event_shape(dist.event_shape)
        if not event.is_fully_defined():
            return None
        return (*dist.batch_shape, *event), jax.dtypes.canonicalize_dtype(dist.dtype)
    except (AttributeError, TypeError, ValueError):
        return None


def _from_noise(dist: Any, key: Any, name: str, mode: SowMode) -> Any:
    """The draw made from its exogenous noise (for `counterfactual`, see `_mechanisms.py`)."""
    k_noise, k_abduce = jax.random.split(key)
    shape = jax.eval_shape(lambda k: dist.sample(seed=k), k_noise)
    how = mechanism(dist, name)
    noise = sow(how.noise(k_noise, shape.shape), tag=NOISE, name=name, mode=mode)
    value = sow(how.forward(noise).astype(shape.dtype), tag=RANDOM_VARIABLE, name=name, mode=mode)
    sow(how.abduce(value, k_abduce), tag=ABDUCED, name=name, mode=mode)
    sow_density(log_prob(dist, value), value, name)
    return value


def _check_name(fn_name: str, name: object) -> None:
    if not isinstance(name, str) or not name:
        raise _errors.bad_name(fn_name, name)


def deterministic(value: T, *, name: str) -> T:
    """Records `value` (a function of the draws) as the site `name`, and returns it.

    The site is not random: `trace` returns it beside the random variables,
    `joint_sample` and `joint_log_prob` leave it out.

    Args:
        value: the value to record (any array or pytree).
        name: the site's name (a non-empty string).

    Returns:
        ``value`` itself (or the value planted at ``name``).

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> def model(key):
        ...     z = ppl.random_variable(tfp.distributions.Normal(0.0, 1.0), name="z")(key)
        ...     return ppl.deterministic(jax.numpy.exp(z), name="scale")
        >>> _, sites = ppl.trace(model)(jax.random.key(0))
        >>> bool(sites["scale"] == jax.numpy.exp(sites["z"]))
        True
    """
    _check_name("deterministic", name)
    return sow(value, tag=DETERMINISTIC, name=name, mode="strict")


def factor(log_weight: Any, *, name: str) -> None:
    """Adds `log_weight` to the program's log density, as the site `name`.

    `joint_log_prob`, `log_prob` and `trace_log_prob` add it (summed over its
    elements) to the densities of the random variables; sampling is unchanged.
    Use it for likelihood terms that are not a distribution, or for soft
    constraints.

    Args:
        log_weight: the term to add to the log density (summed over its elements).
        name: the site's name (a non-empty string).

    Example:
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> def model(key):
        ...     z = ppl.random_variable(tfp.distributions.Normal(0.0, 1.0), name="z")(key)
        ...     ppl.factor(-z**2, name="penalty")
        ...     return z
        >>> ppl.joint_log_prob(model)({"z": 1.0})
        Array(-2.4189386, dtype=float32)
    """
    _check_name("factor", name)
    sow_density(log_weight, (), name)
