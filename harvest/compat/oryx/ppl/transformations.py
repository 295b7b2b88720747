"""oryx.core.ppl.transformations's names and calling conventions, on harvest.ppl.

Replace `from oryx.core.ppl import transformations` with
`from harvest.compat.oryx.ppl import transformations` and nothing else changes.
Written against oryx 0.2.9's documented semantics:

* `random_variable(obj, *, name=None, plate=None)` dispatches on `obj`: a TFP
  distribution becomes a sampler `key -> sample`, a function `f(key, *args)`
  a program whose output is the random variable `name` (its own draws are
  nested under `name`), and an array is tagged as is. Without a name,
  distributions and functions are returned as untagged samplers; an unnamed
  distribution's draw is still scored by `log_prob` (by `dist.log_prob`, as
  oryx scores its `random_variable_p`).
* `log_prob(f)(sample, *args)` inverts `f` (harvest.ppl's inverse walk) and
  scores draws of TFP distributions and of the primitives registered in
  `harvest.compat.oryx.log_prob.log_prob_registry`, as oryx does;
  `joint_log_prob(f)` is `log_prob(joint_sample(f))` and
  `trace_log_prob(f)(out, latents, *args)` is `log_prob(trace(f))`.
* `joint_sample`, `trace` (= `call_and_reap`), `block`, `intervene`,
  `conditional(f, names)(key, *args, *values)`.
* `graph_replace` as oryx 0.2.9 behaves: the outputs leave the program, and
  every other draw is reaped and sown again at the program's end, so it is
  disconnected from what happens downstream (harvest.ppl's `graph_replace`
  keeps them connected).
* `plate(f, name=...)` uses a named axis that an outer `jax.vmap(...,
  axis_name=name)` provides: each index draws with `fold_in(key, index)`, and
  log densities are summed (`psum`) over the axis, so every index reports the
  whole plate's density. Compute densities inside that vmap, as in oryx.
  `harvest.ppl.plate`, which owns its vmap, has no such pitfall.

Differences from oryx are listed in docs/guides/probabilistic_intervention.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, overload

import jax
import jax.numpy as jnp

from .... import ppl as _ppl
from ...._calling._transforms import call_and_reap, nest
from ...._typing import P, R, Reaped
from ...._walk._sow import sow
from ....ppl._log_prob import PLATE_SCOPE, log_density
from ....ppl._random_variable import is_distribution
from ....ppl._tags import LOG_DENSITY, sow_density
from ....ppl._tfp_traces import log_prob as _tfp_log_prob
from .. import log_prob as _lp

Program = Callable[..., Any]
LogProbFunction = Callable[..., Any]

RANDOM_VARIABLE = _ppl.RANDOM_VARIABLE
joint_sample = _ppl.joint_sample
intervene = _ppl.intervene
conditional = _ppl.conditional
block = _ppl.block

__all__ = [
    "RANDOM_VARIABLE",
    "block",
    "conditional",
    "graph_replace",
    "intervene",
    "joint_log_prob",
    "joint_sample",
    "log_prob",
    "nest",
    "plate",
    "random_variable",
    "rv",
    "trace",
    "trace_log_prob",
]


def log_prob(f: Any) -> LogProbFunction:
    """oryx's log_prob: the density of a distribution, or of a program's output by inversion.

    Args:
        f: a TFP distribution, or a program ``f(key, *args)`` whose output is
            an invertible function of its draws (including draws of primitives
            registered in ``harvest.compat.oryx.log_prob``).

    Returns:
        ``f.log_prob`` for a distribution; for a program, a function
        ``(sample, *args) -> log density`` of the output ``sample``.

    Raises:
        NotImplementedError: if ``f`` is neither a distribution nor callable.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from harvest.compat.oryx import ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> def model(key):
        ...     return jnp.exp(ppl.random_variable(tfp.distributions.Normal(0.0, 1.0), name="z")(key))
        >>> ppl.log_prob(model)(1.0)
        Array(-0.9189385, dtype=float32)
    """
    if is_distribution(f):
        dist_log_prob: LogProbFunction = f.log_prob
        return dist_log_prob
    if not callable(f):
        raise NotImplementedError(f"`log_prob` not implemented for type: {type(f)}")

    @functools.wraps(f)
    def wrapped(sample: Any, *args: Any, **kwargs: Any) -> Any:
        return log_density(
            f, sample, args, kwargs, densities=_lp.registered(), plain_samplers_ok=True
        )

    return wrapped


def joint_log_prob(f: Program) -> LogProbFunction:
    """oryx's joint_log_prob: ``log_prob(joint_sample(f))``.

    Args:
        f: a program ``f(key, *args)`` whose draws are named by ``random_variable``.

    Returns:
        A function ``(latents, *args) -> joint log density``, where ``latents``
        is ``{name: value}`` for every draw.

    Example:
        >>> from harvest.compat.oryx import ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> model = ppl.random_variable(tfp.distributions.Normal(0.0, 1.0), name="z")
        >>> ppl.joint_log_prob(model)({"z": 0.0})
        Array(-0.9189385, dtype=float32)
    """
    return log_prob(joint_sample(f))


def trace(f: Callable[P, R]) -> Callable[P, tuple[R, Reaped]]:
    """oryx's trace: ``(key, *args) -> (output, {name: random variable})``.

    Args:
        f: a program ``f(key, *args)`` with named draws.

    Returns:
        A function with ``f``'s arguments returning ``(output, latents)``.

    Example:
        >>> import jax
        >>> from harvest.compat.oryx import ppl
        >>> out, latents = ppl.trace(ppl.random_variable(jax.random.normal, name="x"))(jax.random.PRNGKey(0))
        >>> bool(out == latents["x"])
        True
    """
    return call_and_reap(f, tag=RANDOM_VARIABLE)


def trace_log_prob(f: Program) -> LogProbFunction:
    """oryx's trace_log_prob: ``(output, latents, *args) -> log_prob(trace(f))((output, latents), *args)``.

    Args:
        f: a program ``f(key, *args)`` with named draws.

    Returns:
        A function ``(output, latents, *args) -> log density`` of the output and
        the draws together.

    Example:
        >>> from harvest.compat.oryx import ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> model = ppl.random_variable(tfp.distributions.Normal(0.0, 1.0), name="z")
        >>> ppl.trace_log_prob(model)(0.0, {"z": 0.0})
        Array(-0.9189385, dtype=float32)
    """
    return lambda obs, latents, *args: log_prob(trace(f))((obs, latents), *args)


def _resow_summed(densities: Reaped, axis_name: str, scope: tuple[str, ...] = ()) -> None:
    """Sows each reaped log density again, summed over the plate's axis."""
    for key, value in densities.items():
        if isinstance(value, dict):
            _resow_summed(value, axis_name, scope + (key,))
            continue
        resow: Callable[..., None] = functools.partial(sow_density, name=key)
        for outer in reversed(scope):
            resow = nest(resow, scope=outer)
        for density, drawn in value:
            resow(jax.lax.psum(jnp.sum(density), axis_name), drawn)


@overload
def plate(f: Callable[P, R], name: str) -> Callable[P, R]: ...
@overload
def plate(f: None = None, *, name: str) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
def plate(f: Callable[..., Any] | None = None, name: str | None = None) -> Callable[..., Any]:
    """oryx's plate: independent draws along the named axis ``name``.

    Used as ``plate(f, name=...)`` or as the decorator ``@plate(name=...)``; run
    the result under ``jax.vmap(..., axis_name=name)``.

    Args:
        f: the program ``f(key, *args)`` to draw independently per index of the
            axis; omitted when ``plate`` is used as a decorator.
        name: the named axis (as given to ``jax.vmap``'s ``axis_name``); each
            index folds its position into the key, and ``log_prob`` sums the
            densities over the axis.

    Returns:
        The plated program, or, without ``f``, a decorator that plates one.

    Raises:
        TypeError: if ``name`` is not a non-empty string.

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


def _plated(f: Program, axis_name: str) -> Program:
    scored = call_and_reap(f, tag=LOG_DENSITY)

    @functools.wraps(f)
    def plated(key: Any, *args: Any, **kwargs: Any) -> Any:
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
        # The scope tells log_prob to sum the densities it finds inside over the axis.
        with jax.named_scope(PLATE_SCOPE.format(axis_name)):
            out, densities = scored(key, *args, **kwargs)
        _resow_summed(densities, axis_name)
        return out

    return plated


def _function_random_variable(f: Program, name: str | None, plate_name: str | None) -> Program:
    def program(*args: Any, **kwargs: Any) -> Any:
        fun = f if plate_name is None else _plated(f, plate_name)
        if name is None:
            return fun(*args, **kwargs)
        out = nest(fun, scope=name)(*args, **kwargs)
        return sow(out, tag=RANDOM_VARIABLE, name=name, mode="strict")

    return program


def random_variable(obj: Any, *, name: str | None = None, plate: str | None = None) -> Any:  # noqa: A002 (oryx's keyword)
    """oryx's random_variable: tags a value, or turns a distribution or function into a sampler.

    Args:
        obj: a TFP distribution (becomes a sampler ``key -> draw``), a function
            (a program, whose output is tagged and whose inner names are scoped
            under ``name``), or a value (tagged as it is).
        name: the draw's name; None for an unnamed sampler (a value needs one).
        plate: a named axis to draw independently along (see ``plate``).

    Returns:
        A sampler or program for a distribution or a function; the value itself
        (or its planted replacement) for a value.

    Raises:
        ValueError: for a value given without ``name``, or with ``plate``.

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
        sampler = _unnamed_sampler(obj) if name is None else _ppl.random_variable(obj, name=name)
        return sampler if plate is None else _plated(sampler, plate)
    if callable(obj):
        return _function_random_variable(obj, name, plate)
    if name is None:
        raise ValueError(f"Cannot call `random_variable` on {type(obj)} without passing in a name.")
    if plate is not None:
        raise ValueError(f"Cannot call `random_variable` on {type(obj)} with a plate.")
    return sow(obj, tag=RANDOM_VARIABLE, name=name, mode="strict")


rv = random_variable

# The site under which an unnamed draw files its density: not a random variable (no
# value to reap or plant), but scored by `log_prob` wherever the output determines it.
UNNAMED = "oryx_unnamed_draw"


def _unnamed_sampler(dist: Any) -> Program:
    """oryx's unnamed draw: untagged, but scored by ``dist.log_prob`` like a named one."""

    def sample(key: Any) -> Any:
        value = dist.sample(seed=key)
        sow_density(_tfp_log_prob(dist, value), value, UNNAMED)
        return value

    return sample


def graph_replace(
    f: Program, input_names: str | list[str], output_names: str | list[str]
) -> Program:
    """oryx's graph_replace: a program from ``input_names`` to ``output_names``.

    As in oryx 0.2.9, the other draws are reaped and re-sown at the end of the
    new program: still named, but no longer connected to what they fed.

    Args:
        f: the program ``f(key, *args)``.
        input_names: the random variables that become inputs (after ``args``).
        output_names: the random variables returned (one name: one value).

    Returns:
        The program ``g(key, *args, *inputs)``.

    Example:
        >>> import jax
        >>> from harvest.compat.oryx import ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> def chain(key):
        ...     k1, k2 = jax.random.split(key)
        ...     z = ppl.random_variable(tfp.distributions.Normal(0.0, 1.0), name="z")(k1)
        ...     return ppl.random_variable(tfp.distributions.Normal(z, 1.0), name="x")(k2)
        >>> ppl.log_prob(ppl.graph_replace(chain, "z", "x"))(5.0, 5.0)
        Array(-0.9189385, dtype=float32)
    """
    single = isinstance(output_names, str)
    outputs = (output_names,) if isinstance(output_names, str) else tuple(output_names)
    given = _ppl.conditional(f, input_names)

    def replaced(*args: Any, **kwargs: Any) -> Any:
        draws = _ppl.joint_sample(given)(*args, **kwargs)
        missing = [n for n in outputs if n not in draws]
        if missing:
            raise KeyError(
                f"graph_replace: {', '.join(missing)} are not random variables of the "
                f"program (or are among its inputs). Its random variables are: "
                f"{', '.join(sorted(draws)) or 'none'}."
            )
        for name, value in draws.items():
            if name not in outputs:
                sow(value, tag=RANDOM_VARIABLE, name=name, mode="strict")
        values = [draws[n] for n in outputs]
        return values[0] if single else values

    return replaced
