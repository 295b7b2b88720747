"""oryx.core.ppl's names and calling conventions, on harvest.ppl.

Written against oryx 0.2.9's documented semantics:

* `random_variable(obj, *, name=None, plate=None)` dispatches on `obj`: a TFP
  distribution becomes a sampler `key -> sample`, a function `f(key, *args)`
  a program whose output is the random variable `name` (its own draws are
  nested under `name`), and an array is tagged as is. Without a name,
  distributions and functions are returned as untagged samplers.
* `joint_sample(f)(key, *args) -> {name: value}`;
  `joint_log_prob(f)(values, *args)`; `log_prob(f)(output, *args)`;
  `intervene(f, **values)`; `conditional(f, names)(key, *args, *values)`.
* `plate(f, name=...)` uses a named axis that an outer `jax.vmap(...,
  axis_name=name)` provides: each index draws with `fold_in(key, index)`, and
  log densities are summed (`psum`) over the axis, so every index reports the
  whole plate's density. Compute densities inside that vmap, as in oryx; a
  `joint_log_prob` taken outside it would count the plate once per index.
  `harvest.ppl.plate`, which owns its vmap, has no such pitfall.

Differences from oryx: `log_prob` of a program does not invert computations
(it scores programs that return their random variables), and a distribution
with a batch shape is allowed (its density is summed over the batch).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ... import ppl as _ppl
from ..._sow import sow
from ..._transforms import call_and_reap, nest
from ...ppl._random_variable import LOG_DENSITY, is_distribution

RANDOM_VARIABLE = _ppl.RANDOM_VARIABLE
joint_sample = _ppl.joint_sample
joint_log_prob = _ppl.joint_log_prob
log_prob = _ppl.log_prob
intervene = _ppl.intervene
conditional = _ppl.conditional

__all__ = [
    "RANDOM_VARIABLE",
    "conditional",
    "intervene",
    "joint_log_prob",
    "joint_sample",
    "log_prob",
    "nest",
    "plate",
    "random_variable",
    "rv",
]


def _resow_summed(densities, axis_name, scope=()):
    """Sows each reaped log density again, summed over the plate's axis."""
    for key, value in densities.items():
        if isinstance(value, dict):
            _resow_summed(value, axis_name, scope + (key,))
            continue
        total = jax.lax.psum(sum(jnp.sum(v) for v in jax.tree_util.tree_leaves(value)), axis_name)
        # "collect", like random_variable's own density sows: it works in and out of loops.
        resow = functools.partial(sow, tag=LOG_DENSITY, name=key, mode="collect")
        for outer in reversed(scope):
            resow = nest(resow, scope=outer)
        resow(total)


def plate(f=None, name=None):
    """oryx's plate: independent draws along the named axis `name`.

    Example:
        >>> import jax
        >>> from harvest.compat.oryx import ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> @ppl.plate(name="foo")
        ... def model(key):
        ...     return ppl.random_variable(tfp.distributions.Normal(0.0, 1.0), name="x")(key)
        >>> draws = jax.vmap(model, axis_name="foo", in_axes=None, axis_size=3)(jax.random.PRNGKey(0))
        >>> bool(draws[0] != draws[1])
        True
        >>> jax.vmap(ppl.log_prob(model), axis_name="foo")(jax.numpy.zeros(3))
        Array([-2.7568154, -2.7568154, -2.7568154], dtype=float32)
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"plate needs `name`, the named axis to draw along, got {name!r}.")
    transform = functools.partial(_plated, axis_name=name)
    return transform if f is None else transform(f)


def _plated(f, axis_name):
    scored = call_and_reap(f, tag=LOG_DENSITY)

    @functools.wraps(f)
    def plated(key, *args, **kwargs):
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
        out, densities = scored(key, *args, **kwargs)
        _resow_summed(densities, axis_name)
        return out

    return plated


def _function_random_variable(f, name, plate_name):
    def program(*args, **kwargs):
        fun = f if plate_name is None else _plated(f, plate_name)
        if name is None:
            return fun(*args, **kwargs)
        out = nest(fun, scope=name)(*args, **kwargs)
        return sow(out, tag=RANDOM_VARIABLE, name=name, mode="strict")

    return program


def random_variable(obj, *, name=None, plate=None):  # noqa: A002 (oryx's keyword)
    """oryx's random_variable: tags a value, or turns a distribution or function into a sampler.

    Example:
        >>> import jax
        >>> from harvest.compat.oryx import ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> def model(key):
        ...     k1, k2 = jax.random.split(key)
        ...     z = ppl.random_variable(tfp.distributions.Normal(0.0, 1.0), name="z")(k1)
        ...     return z + ppl.random_variable(jax.random.normal, name="x")(k2)
        >>> sorted(ppl.joint_sample(model)(jax.random.PRNGKey(0)))
        ['x', 'z']
        >>> ppl.intervene(model, z=1.0, x=1.0)(jax.random.PRNGKey(0))
        Array(2., dtype=float32, weak_type=True)
        >>> ppl.random_variable(jax.numpy.ones(2), name="w")
        Array([1., 1.], dtype=float32)
    """
    if is_distribution(obj):
        if name is None:
            return lambda key: obj.sample(seed=key)
        sampler = _ppl.random_variable(obj, name=name)
        return sampler if plate is None else _plated(sampler, plate)
    if callable(obj):
        return _function_random_variable(obj, name, plate)
    if name is None:
        raise ValueError(f"Cannot call random_variable on a {type(obj).__name__} without a name.")
    if plate is not None:
        raise ValueError(f"Cannot call random_variable on a {type(obj).__name__} with a plate.")
    return sow(obj, tag=RANDOM_VARIABLE, name=name, mode="strict")


rv = random_variable
