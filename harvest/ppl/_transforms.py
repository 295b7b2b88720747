"""The transformations of probabilistic programs: sample, score, fix.

A probabilistic program is a function `model(key, *args)` whose draws are made
with `random_variable`. Every transformation here is `reap`, `plant` or
`harvest` of the two tags that `random_variable` sows (see
`_random_variable.py`):

* `joint_sample` reaps the samples;
* `joint_log_prob` plants every sample and reaps the log densities;
* `intervene` / `conditional` plant some samples and drop their log
  densities, so the fixed variables are no longer random.

Scoring needs no randomness, so the score functions trace the program with a
placeholder key, as oryx does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Concatenate, overload

import jax
import jax.numpy as jnp
from jax.tree_util import Partial

from .. import _jax
from .._calling._transforms import call_and_reap, harvest_tags, layer_tag, plant, reap
from .._typing import P, Plants, R, Reaped
from .._walk._sow import sow
from . import _errors
from ._block import check_blocked_unscored, with_draws_replaced
from ._enumerate import marginal, supports
from ._log_prob import log_density
from ._names import Among, check_drawn, dotted_paths, leaf_paths, merged, nested
from ._old_spellings import model_was_f
from ._random_variable import is_distribution
from ._tags import (
    BLOCKED,
    DETERMINISTIC,
    ENUMERATED,
    ENUMERATED_IN_SCAN,
    LOG_DENSITY,
    RANDOM_VARIABLE,
    TOTAL,
    densities_of,
    scoring,
)


def _placeholder_key() -> jax.Array:
    return jax.random.PRNGKey(0)


def _check_values(values: object, fn_name: str) -> None:
    if not isinstance(values, dict):
        raise TypeError(
            f"{fn_name} takes the values of random variables as a dict {{name: value}} "
            f"(as joint_sample returns it), got a {type(values).__name__}."
        )


@model_was_f
def joint_sample(model: Callable[P, Any]) -> Callable[P, Reaped]:
    """Returns a program `(key, *args) -> {name: value}` with every draw of `model`.

    Names put under a scope by `nest` come back as nested dicts; draws of mode
    `"append"` come back stacked on a leading axis.

    Args:
        model: the probabilistic program ``model(key, *args)``.

    Returns:
        The program ``(key, *args) -> {name: value}``.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def model(key):
        ...     k1, k2 = jax.random.split(key)
        ...     z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
        ...     return ppl.random_variable(tfd.Normal(z, 0.5), name="x")(k2)
        >>> draws = jax.vmap(ppl.joint_sample(model))(jax.random.split(jax.random.key(0), 4))
        >>> draws["z"].shape, draws["x"].shape
        ((4,), (4,))
    """
    return Partial(_joint_sample, model)


def _joint_sample(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Reaped:
    return reap(f, tag=RANDOM_VARIABLE)(*args, **kwargs)


def _unscored(values: Reaped, densities: Reaped) -> list[str]:
    """Names in `values` that have no log density (drawn by a plain sampler)."""
    missing = []
    for key, value in values.items():
        if key not in densities:
            missing.append(key)
        elif isinstance(value, dict) and isinstance(densities[key], dict):
            missing += [f"{key}.{n}" for n in _unscored(value, densities[key])]
    return missing


# The transformed programs below are `jax.tree_util.Partial`s of module-level
# functions: the program `f` and the names are static, the planted values are
# array leaves. The core caches its traces by exactly that split, so scoring or
# intervening the same program again, with new values, reuses the compiled walk.


def _joint_log_prob(f: Callable[..., Any], values: Plants, *args: Any, **kwargs: Any) -> Any:
    _check_values(values, "joint_log_prob(f)")
    if _jax.staged_beneath():  # the outer jit is the cache: a walk would only re-bind the program
        return _density(f, values, args, kwargs)
    return reap(Partial(_total, f), tag=TOTAL)(values, *args, **kwargs)["total"]


def _total(f: Callable[..., Any], values: Plants, *args: Any, **kwargs: Any) -> None:
    """Sows the log density of `f` at `values`. Called eagerly, the core traces this
    once per signature, so its checks and its search for enumerated draws cost nothing later."""
    sow(_density(f, values, args, kwargs), tag=TOTAL, name="total", mode="strict")


def _density(f: Callable[..., Any], values: Plants, args: Any, kwargs: Any) -> Any:
    """The log density of `f` at `values`. Every value is given, so no draw is
    sampled (the scoring switch)."""
    with scoring():
        return _scored(f, values, args, kwargs)


def _scored(f: Callable[..., Any], values: Plants, args: Any, kwargs: Any) -> Any:
    # One walk plants the values and finds the densities, the draws without a value,
    # the enumerated and the blocked.
    tags = (RANDOM_VARIABLE, LOG_DENSITY, ENUMERATED, BLOCKED, ENUMERATED_IN_SCAN)
    reaped = walked(f, tags, values, args, kwargs)
    unplanted, densities, markers, blocked, in_scan = (reaped.get(tag, {}) for tag in tags)
    if blocked:
        check_blocked_unscored(Partial(_score, f), (values, *args), kwargs, "joint_log_prob")
    missing = set(leaf_paths(unplanted))
    enumerated = supports(markers, missing, in_scan)
    if missing - set(enumerated):
        raise ValueError(
            "joint_log_prob needs a value for every random variable; missing: "
            f"{', '.join(sorted(missing - set(enumerated)))}. Give them too, fix them "
            "first with intervene/conditional, or (Bernoulli, Categorical) draw them with "
            "enumerate=True to sum them out."
        )
    if enumerated:
        total = marginal(lambda a: _site_densities(f, merged(values, a), args, kwargs), enumerated)
    else:
        unscored = _unscored(values, densities)
        if unscored:
            raise _errors.drawn_without_density("joint_log_prob", unscored)
        total = sum(densities_of(densities), jnp.zeros(()))
    return total


def _site_densities(f: Callable[..., Any], values: Plants, args: Any, kwargs: Any) -> Reaped:
    densities: Reaped = walked(f, (RANDOM_VARIABLE, LOG_DENSITY), values, args, kwargs).get(
        LOG_DENSITY, {}
    )
    return densities


def walked(
    f: Callable[..., Any], tags: tuple[str, ...], values: Plants, args: Any, kwargs: Any
) -> Reaped:
    """`{tag: {name: value}}` of one walk of `f` under a placeholder key, with `values`
    planted at its random variables and every other site of `tags` reaped."""
    plants = {RANDOM_VARIABLE: values} if values else {}
    try:
        return harvest_tags(f, tags)(plants, _placeholder_key(), *args, **kwargs)[1]
    except KeyError:
        check_drawn("joint_log_prob", f, leaf_paths(values), (_placeholder_key(), *args), kwargs)
        raise


def _score(f: Callable[..., Any], values: Plants, *args: Any, **kwargs: Any) -> Any:
    return sum(densities_of(_site_densities(f, values, args, kwargs)))


@model_was_f
def joint_log_prob(
    model: Callable[Concatenate[Any, P], Any],
) -> Callable[Concatenate[Plants, P], jax.Array]:
    """Returns `log_density({name: value}, *args) -> scalar` for the program `model`.

    It is the sum of every random variable's log density at the given values,
    so every random variable of `model` needs a value. The function is
    differentiable in the values and works under `jit` and `vmap`.

    Args:
        model: the probabilistic program ``model(key, *args)``.

    Returns:
        The function ``log_density(values, *args) -> scalar``.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def model(key):
        ...     k1, k2 = jax.random.split(key)
        ...     z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
        ...     return ppl.random_variable(tfd.Normal(z, 1.0), name="x")(k2)
        >>> ppl.joint_log_prob(model)({"z": 0.0, "x": 0.0})
        Array(-1.837877, dtype=float32)
        >>> jax.grad(ppl.joint_log_prob(model))({"z": 1.0, "x": 0.0})["z"]
        Array(-2., dtype=float32)
    """
    return Partial(_joint_log_prob, model)


def _fixed(
    f: Callable[..., Any], names: frozenset[str], values: Plants, *args: Any, **kwargs: Any
) -> Any:
    """`f` with the random variables `names` set to `values` and their log
    densities dropped (reaped and thrown away)."""
    requested = leaf_paths(values)
    return with_draws_replaced(f, names, values, requested, "intervene/conditional", args, kwargs)


@model_was_f
def intervene(model: Callable[P, R], /, **values: Any) -> Callable[P, R]:
    """The do-operator: `model` with the named random variables set to `values`.

    Everything downstream of an intervened variable uses its value, and the
    variable is no longer random: `joint_sample` leaves it out and
    `joint_log_prob` neither asks for it nor counts its density. Other random
    variables are unaffected. Give a scoped (`nest`) variable as a nested dict.

    Args:
        model: the probabilistic program ``model(key, *args)`` (positional, so that a
            random variable may be called ``model`` or ``f``).
        values: the random variables to fix, by name (keyword arguments), and their values.

    Returns:
        The program ``model`` with those variables fixed, called as ``model`` is.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def model(key):
        ...     k1, k2 = jax.random.split(key)
        ...     z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
        ...     return ppl.random_variable(tfd.Normal(z, 1.0), name="x")(k2)
        >>> fixed = ppl.intervene(model, z=3.0)
        >>> list(ppl.joint_sample(fixed)(jax.random.key(0)))
        ['x']
        >>> ppl.joint_log_prob(fixed)({"x": 3.0})
        Array(-0.9189385, dtype=float32)
    """
    return Partial(_fixed, model, frozenset(dotted_paths(values)), values)


@model_was_f
def conditional(model: Callable[..., R], names: str | Iterable[str]) -> Callable[..., R]:
    """Returns a program that takes the values of the random variables `names` as inputs.

    The new program is called as `g(key, *args, *values)`: the values of
    `names`, in order, come after `model`'s own arguments (as in oryx). A single
    name may be given as a string. Scoped names are dotted (`"scope.x"`). As
    with `intervene`, the given variables are no longer random.

    Args:
        model: the probabilistic program ``model(key, *args)``.
        names: the random variables to take as inputs (a name, or a list of names).

    Returns:
        The program ``g(key, *args, *values)`` (``model`` itself when ``names`` is empty).

    Raises:
        TypeError: if a name is not a non-empty string.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def model(key):
        ...     k1, k2 = jax.random.split(key)
        ...     z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
        ...     return ppl.random_variable(tfd.Normal(z, 1.0), name="x")(k2)
        >>> given = ppl.conditional(model, ["z", "x"])
        >>> given(jax.random.key(0), 1.0, 2.0)  # x's value, as given (traced, as every value)
        Array(2., dtype=float32, weak_type=True)
        >>> ppl.joint_log_prob(ppl.conditional(model, "z"))({"x": 0.0}, 0.0)
        Array(-0.9189385, dtype=float32)
    """
    names = [names] if isinstance(names, str) else list(names)
    if not all(isinstance(n, str) and n for n in names):
        raise _errors.names_not_strings("conditional", "random variable names", names)
    if not names:
        return model
    return Partial(_conditioned, model, tuple(names))


def _conditioned(f: Callable[..., Any], names: tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
    if len(args) < len(names):
        raise TypeError(
            f"conditional(f, {list(names)}) is called as g(key, *args, *values) with one "
            f"value per name; got {len(args)} positional arguments in all."
        )
    split = len(args) - len(names)
    values = nested(names, args[split:])
    return _fixed(f, frozenset(dotted_paths(nested(names, names))), values, *args[:split], **kwargs)


# ---------------------------------------------------------------------------
# log_prob by inversion, and what is built on it.


@overload
def log_prob(
    model: Callable[Concatenate[Any, P], Any],
) -> Callable[Concatenate[Any, P], jax.Array]: ...
@overload
def log_prob(model: Any) -> Callable[..., jax.Array]: ...
@model_was_f
def log_prob(model: Any) -> Callable[..., jax.Array]:
    """Returns `log_density(value, *args)` of a distribution or of a program's output.

    For a TFP distribution this is its own `log_prob`. For a program
    `model(key, *args)`, `value` is shaped like its output, and the density is
    found by inverting `model`: every draw the output depends on is recovered from
    `value` (through the invertible primitives listed in the guide: `exp`,
    `log`, affine maps by known values, `tanh`, `sigmoid`, `softplus`,
    reshapes, ...), scored at that value, and the log-det-Jacobian of the
    inversion is added. Draws the output does not depend on integrate out. A
    draw the output depends on but does not determine (a latent) is an error:
    use `joint_log_prob`, or `log_prob(joint_sample(model))`, which is exactly
    `joint_log_prob(model)`. Eager by default (as oryx); wrap it in `jax.jit`.

    Args:
        model: a TFP distribution, or a probabilistic program ``model(key, *args)``.

    Returns:
        The function ``log_density(value, *args) -> scalar``.

    Raises:
        TypeError: if ``model`` is neither a distribution nor callable.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def log_normal(key):
        ...     return jnp.exp(ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(key))
        >>> ppl.log_prob(log_normal)(2.0)
        Array(-1.8523122, dtype=float32)
        >>> tfd.LogNormal(0.0, 1.0).log_prob(2.0)
        Array(-1.8523122, dtype=float32)
    """
    if is_distribution(model):
        dist_log_prob: Callable[..., jax.Array] = model.log_prob
        return dist_log_prob
    if not callable(model):
        raise TypeError(
            f"log_prob takes a TFP distribution or a program, got a {type(model).__name__}."
        )
    if isinstance(model, Partial) and model.func is _joint_sample:
        return joint_log_prob(*model.args)
    return Partial(_log_prob, model)


def _log_prob(f: Callable[..., Any], value: Any, *args: Any, **kwargs: Any) -> Any:
    return log_density(f, value, args, kwargs)


@model_was_f
def trace(model: Callable[P, R]) -> Callable[P, tuple[R, Reaped]]:
    """Returns a program `(key, *args) -> (output, {name: value})` with every recorded site.

    The dict holds the random variables (as `joint_sample` returns them) and the
    `deterministic` sites.

    Args:
        model: the probabilistic program ``model(key, *args)``.

    Returns:
        The program ``(key, *args) -> (output, {name: value})``.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> def model(key):
        ...     z = ppl.random_variable(tfp.distributions.Normal(0.0, 1.0), name="z")(key)
        ...     return ppl.deterministic(2.0 * z, name="twice")
        >>> out, sites = ppl.trace(model)(jax.random.key(0))
        >>> sorted(sites), bool(out == sites["twice"] == 2 * sites["z"])
        (['twice', 'z'], True)
    """
    return Partial(_trace, model)


def _trace(f: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Reaped]:
    out, draws = call_and_reap(Partial(_with_deterministic, f), tag=RANDOM_VARIABLE)(
        *args, **kwargs
    )
    out, recorded = out
    return out, {**draws, **recorded}


def _with_deterministic(f: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Reaped]:
    return call_and_reap(f, tag=DETERMINISTIC)(*args, **kwargs)


@model_was_f
def trace_log_prob(
    model: Callable[Concatenate[Any, P], R],
) -> Callable[Concatenate[R, Reaped, P], jax.Array]:
    """Returns `log_density(output, sites, *args)`: the density of `trace(model)`'s result.

    Args:
        model: the probabilistic program ``model(key, *args)``.

    Returns:
        The function ``log_density(output, sites, *args) -> scalar``.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def model(key):
        ...     k1, k2 = jax.random.split(key)
        ...     z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
        ...     return ppl.random_variable(tfd.Normal(z, 1.0), name="x")(k2)
        >>> ppl.trace_log_prob(model)(1.0, {"z": 0.0, "x": 1.0})
        Array(-2.337877, dtype=float32)
    """
    return Partial(_trace_log_prob, model)


def _trace_log_prob(
    f: Callable[..., Any], out: Any, sites: Reaped, *args: Any, **kwargs: Any
) -> Any:
    return log_density(trace(f), (out, sites), args, kwargs)


@model_was_f
def graph_replace(
    model: Callable[..., Any],
    input_names: str | Iterable[str],
    output_names: str | Iterable[str],
) -> Callable[..., Any]:
    """Re-expresses ``model`` as a program from the random variables ``input_names`` to ``output_names``.

    The new program is called as ``g(key, *args, *inputs)`` (as ``conditional``)
    and returns the values of ``output_names`` (a list, or one value for a
    single name given as a string). Every draw that is not an input stays a
    random variable where it was: the outputs and the others alike, so
    ``intervene``, ``conditional`` and ``joint_log_prob`` of the new program
    treat them as in ``model`` (intervening on a draw changes the draws downstream
    of it). ``harvest.compat.oryx``'s ``graph_replace`` keeps oryx 0.2.9's
    behaviour instead (outputs leave the program, the other draws are re-sown
    at its end, disconnected).

    Args:
        model: the program ``model(key, *args)``.
        input_names: the random variables that become inputs, in order (a
            name, or a list of names).
        output_names: the random variables to return (a name, or a list).

    Returns:
        The program ``g(key, *args, *inputs)``.

    Raises:
        TypeError: if a name is not a non-empty string.
        KeyError: (when ``g`` is called) if an output is not a random variable
            of ``model`` or is among the inputs.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def chain(key):
        ...     k1, k2, k3 = jax.random.split(key, 3)
        ...     z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
        ...     x = ppl.random_variable(tfd.Normal(z, 1.0), name="x")(k2)
        ...     return ppl.random_variable(tfd.Normal(x, 1.0), name="y")(k3)
        >>> z_to_y = ppl.graph_replace(chain, "z", "y")
        >>> sorted(ppl.joint_sample(z_to_y)(jax.random.key(0), 5.0))
        ['x', 'y']
        >>> ppl.joint_log_prob(z_to_y)({"x": 5.0, "y": 5.0}, 5.0)
        Array(-1.837877, dtype=float32)
        >>> y = ppl.intervene(z_to_y, x=100.0)(jax.random.key(0), 5.0)
        >>> bool(90.0 < y < 110.0)  # y is drawn downstream of the intervened x
        True
    """
    single = isinstance(output_names, str)
    outputs = [output_names] if single else list(output_names)
    if not all(isinstance(n, str) and n for n in outputs):
        raise _errors.names_not_strings("graph_replace", "output names", output_names)
    return Partial(
        _replaced, conditional(model, input_names), output_names if single else tuple(outputs)
    )


# The tag under which graph_replace's program files the values it returns.
_REPLACED = layer_tag("random_variable_graph_replace_output")


@dataclasses.dataclass(frozen=True)
class _KeepAndReturn:
    """The plant at an output draw: the draw stays a random variable where it was
    (re-sown under `RANDOM_VARIABLE`), and its value, planted or not, is filed to return."""

    name: str

    def __call__(self, value: Any) -> Any:
        kept = sow(value, tag=RANDOM_VARIABLE, name=self.name, mode="strict")
        return sow(kept, tag=_REPLACED, name=self.name, mode="strict")


def _kept(given: Callable[..., Any], outputs: Among, *args: Any, **kwargs: Any) -> Any:
    plants = {name: _KeepAndReturn(name) for name in sorted(outputs.names)}
    return plant(given, tag=RANDOM_VARIABLE, names=outputs)(plants, *args, **kwargs)


def _replaced(
    given: Callable[..., Any], output_names: str | tuple[str, ...], *args: Any, **kwargs: Any
) -> Any:
    outputs = (output_names,) if isinstance(output_names, str) else output_names
    try:
        values = reap(Partial(_kept, given, Among(frozenset(outputs))), tag=_REPLACED)(
            *args, **kwargs
        )
    except KeyError:
        caller = "graph_replace (outputs that are inputs are not random variables)"
        check_drawn(caller, given, outputs, args, kwargs)
        raise
    returned = [_at(values, n) for n in outputs]
    return returned[0] if isinstance(output_names, str) else returned


def _at(tree: Reaped, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree
