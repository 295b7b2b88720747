"""`unconstrained`: a program's log density over unconstrained values, for HMC/NUTS.

Gradient-based samplers move in all of R^n, but a scale is positive and a
probability lies in (0, 1). Each TFP distribution names the bijection from
R^n onto its support (`experimental_default_event_space_bijector`). While
`unconstrained` traces the program, `random_variable` draws each free
variable as `value = bijector.forward(u)`, with `u` sown under
`UNCONSTRAINED`, and adds `log |d forward / du|` to the variable's log
density. The density of `u` is then the model's density, and `constrain`
maps a `u` back to the model's values.

The switch is read while the program is traced. The traced walks are keyed
by their own functions, so they never mix with ordinary traces of the model;
a `jax.jit`-decorated function inside the model that itself draws random
variables would be cached by JAX across both, so draw outside such functions.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import Partial

from .._sow import sow
from .._transforms import harvest, plant, reap
from .._typing import Reaped, SowMode
from ._random_variable import LOG_DENSITY, RANDOM_VARIABLE, densities_of, sow_density

UNCONSTRAINED = "random_variable_unconstrained"

# While tracing for `unconstrained`: the names drawn as they are (observed).
_observed: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "harvest_ppl_unconstrained", default=None
)


@contextlib.contextmanager
def _unconstraining(observed: frozenset[str]) -> Iterator[None]:
    token = _observed.set(observed)
    try:
        yield
    finally:
        _observed.reset(token)


def draw_unconstrained(dist: Any, sample: Any, name: str, mode: SowMode) -> Any:
    """The draw as `random_variable` makes it: unchanged, or through `u` while unconstraining."""
    observed = _observed.get()
    if observed is None or name in observed:
        return sample
    bijector = dist.experimental_default_event_space_bijector()
    if bijector is None:
        raise ValueError(
            f"unconstrained: the random variable {name!r} has a {type(dist).__name__} "
            "distribution, which has no continuous support to unconstrain (it is discrete). "
            "Give it in `observed`, or fix it with intervene."
        )
    u = sow(bijector.inverse(sample), tag=UNCONSTRAINED, name=name, mode=mode)
    event_ndims = len(dist.event_shape)
    sow_density(jnp.sum(bijector.forward_log_det_jacobian(u, event_ndims=event_ndims)), (), name)
    return bijector.forward(u)


def _key() -> jax.Array:
    return jax.random.PRNGKey(0)


def _run(f: Callable[..., Any], observed: Reaped, u: Reaped, *args: Any, **kwargs: Any) -> Any:
    """`f` with the observed values planted and every other draw made from `u`."""
    with _unconstraining(frozenset(observed)):
        out, missing = harvest(Partial(_observed_program, f, observed), tag=UNCONSTRAINED)(
            u, *args, **kwargs
        )
    if missing:
        raise ValueError(
            f"unconstrained: no value for {', '.join(sorted(missing))}. Give every random "
            "variable that is not observed (init(key) gives a starting point)."
        )
    return out


def _observed_program(f: Callable[..., Any], observed: Reaped, *args: Any, **kwargs: Any) -> Any:
    return plant(f, tag=RANDOM_VARIABLE)(observed, _key(), *args, **kwargs)


def _log_density(
    f: Callable[..., Any], observed: Reaped, u: Reaped, *args: Any, **kwargs: Any
) -> Any:
    densities = reap(Partial(_run, f, observed), tag=LOG_DENSITY)(u, *args, **kwargs)
    return sum(densities_of(densities))


def _constrain(
    f: Callable[..., Any], observed: Reaped, u: Reaped, *args: Any, **kwargs: Any
) -> Reaped:
    return reap(Partial(_run, f, observed), tag=RANDOM_VARIABLE)(u, *args, **kwargs)


def _init(f: Callable[..., Any], observed: Reaped, key: Any, *args: Any, **kwargs: Any) -> Reaped:
    return reap(Partial(_prior_draw, f, observed), tag=UNCONSTRAINED)(key, *args, **kwargs)


def _prior_draw(
    f: Callable[..., Any], observed: Reaped, key: Any, *args: Any, **kwargs: Any
) -> Any:
    with _unconstraining(frozenset(observed)):
        return plant(f, tag=RANDOM_VARIABLE)(observed, key, *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Unconstrained:
    """A program's density over unconstrained values `u` (a dict, one entry per free variable).

    `log_density(u, *args)`: the log density of `u`, including the Jacobian of
    each variable's map onto its support. `constrain(u, *args)`: the model's
    values `{name: value}` for `u` (the free variables; observed ones are not
    random). `init(key, *args)`: a `u` drawn from the prior, to start a chain.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> model = lambda key: ppl.random_variable(tfp.distributions.Exponential(1.0), name="rate")(key)
        >>> posterior = ppl.unconstrained(model)
        >>> u = posterior.init(jax.random.key(0))
        >>> list(u), bool(posterior.constrain(u)["rate"] > 0)  # any real u maps to a positive rate
        (['rate'], True)
    """

    log_density: Callable[..., jax.Array]
    constrain: Callable[..., Reaped]
    init: Callable[..., Reaped]


def unconstrained(
    f: Callable[..., Any], observed: Mapping[str, Any] | None = None
) -> Unconstrained:
    """Returns the `Unconstrained` density of the program `f`, with `observed` values fixed.

    Every TFP-distributed random variable not in `observed` becomes free and is
    moved to R^n by its distribution's default event-space bijector (softplus
    for a positive scale, sigmoid for a probability, the identity for a normal);
    the log density adds the log-Jacobian of that map. `observed` (a dict
    `{name: value}`) is scored at its value. Feed `log_density` to `tfp.mcmc`'s
    HMC or NUTS (or any gradient-based sampler) and map the chain back with
    `jax.vmap(constrain)`. Scoped (`nest`) variables are matched in `observed`
    by their own name.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def model(key):
        ...     k1, k2 = jax.random.split(key)
        ...     scale = ppl.random_variable(tfd.HalfNormal(1.0), name="scale")(k1)
        ...     return ppl.random_variable(tfd.Normal(0.0, scale), name="y")(k2)
        >>> posterior = ppl.unconstrained(model, observed={"y": 0.5})
        >>> to_scale = tfd.HalfNormal(1.0).experimental_default_event_space_bijector()  # softplus
        >>> u = {"scale": jnp.array(0.3)}
        >>> scale = to_scale.forward(0.3)
        >>> bool(jnp.allclose(posterior.constrain(u)["scale"], scale))
        True
        >>> expected = (tfd.HalfNormal(1.0).log_prob(scale) + to_scale.forward_log_det_jacobian(0.3)
        ...             + tfd.Normal(0.0, scale).log_prob(0.5))
        >>> bool(jnp.allclose(posterior.log_density(u), expected))
        True
    """
    observed = dict(observed or {})
    if not all(isinstance(k, str) for k in observed):
        raise TypeError(
            f"unconstrained takes observed values as a dict {{name: value}}, got {observed!r}."
        )
    return Unconstrained(
        Partial(_log_density, f, observed),
        Partial(_constrain, f, observed),
        Partial(_init, f, observed),
    )
