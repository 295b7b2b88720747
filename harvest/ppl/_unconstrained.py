"""`unconstrained`: a program's log density over unconstrained values, for HMC/NUTS.

Gradient-based samplers move in all of R^n, but a scale is positive and a
probability lies in (0, 1). Each TFP distribution names the bijection from
R^n onto its support (`experimental_default_event_space_bijector`). While
`unconstrained` traces the program (the switch of `_tags.py`, part of JAX's
jit cache key), `random_variable` draws each continuous variable as
`value = bijector.forward(u)`, with `u` sown under `UNCONSTRAINED` and
`log |d forward / du|` under `JACOBIAN`.

Which draws are free is decided here, after every transformation of the
program has had its say: the draws still visible as random variables once
`observed` is planted are free; `u` is planted for them and only their
Jacobians count. A draw fixed by `intervene` or `conditional` is a constant
(its `u` site is left unplanted and its value replaced downstream); a draw
hidden by `block` is integrated out (see `_block.py`). A free draw without a
`u` site (discrete, or from a plain sampler) is an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import Partial

from .. import _jax
from .._calling._transforms import harvest_tags, reap
from .._typing import Reaped
from .._walk._sow import sow
from . import _errors
from ._block import check_blocked_unscored
from ._enumerate import Support, draw, marginal, supports
from ._names import at_paths, check_drawn, leaf_paths, merged, restricted
from ._old_spellings import model_was_f
from ._tags import (
    BLOCKED,
    DETERMINISTIC,
    ENUMERATED,
    ENUMERATED_IN_SCAN,
    JACOBIAN,
    LOG_DENSITY,
    RANDOM_VARIABLE,
    TOTAL,
    UNCONSTRAINED,
    densities_of,
    scoring,
    unconstraining,
)


def _key() -> jax.Array:
    return jax.random.PRNGKey(0)


def _walked(
    f: Callable[..., Any],
    tags: tuple[str, ...],
    observed: Reaped,
    u: Reaped,
    key: Any,
    args: Any,
    kwargs: Any,
) -> Reaped:
    """`{tag: {name: value}}` of one walk of `f` while unconstraining: `observed`
    planted at its random variables, `u` at its unconstrained sites, every other
    site of `tags` reaped."""
    plants = {tag: v for tag, v in ((RANDOM_VARIABLE, observed), (UNCONSTRAINED, u)) if v}
    try:
        with unconstraining():
            return harvest_tags(f, tags)(plants, key, *args, **kwargs)[1]
    except KeyError:
        check_drawn("unconstrained", f, leaf_paths(observed), (key, *args), kwargs)
        raise


# What `_run` reaps: the free draws, their `u` sites left unplanted (continuous draws
# without a value), their Jacobians and the markers of enumerated draws.
_RUN_TAGS = (RANDOM_VARIABLE, UNCONSTRAINED, JACOBIAN, ENUMERATED, ENUMERATED_IN_SCAN)


def _discrete_free(names: Iterable[str]) -> ValueError:
    return ValueError(
        f"unconstrained: the random variables {', '.join(names)} are discrete, or drawn by "
        "plain sampling functions, so they cannot be moved to R^n. Give them in `observed`, "
        "fix them with intervene or conditional, or (Bernoulli, Categorical) draw them with "
        "random_variable(..., enumerate=True) to sum them out."
    )


def _not_free(names: Iterable[str]) -> ValueError:
    return ValueError(
        f"unconstrained: {', '.join(names)} are not free random variables of the program "
        "(they are observed, fixed by intervene or conditional, or blocked). Leave them out of u."
    )


def _run(
    f: Callable[..., Any],
    observed: Reaped,
    check: bool,
    also: tuple[str, ...],
    u: Reaped,
    *args: Any,
    **kwargs: Any,
) -> tuple[Reaped, jax.Array, dict[str, Support], Reaped]:
    """`f` with the observed values planted and every free draw made from `u`, in one
    walk: `(the free draws, the log-Jacobian of the free draws, the supports of the
    enumerated draws to sum out, the reaps of the tags `also`)`. With `check`, also
    the check for blocked draws; the core traces the caller once per signature, so
    the checks cost nothing on later calls. Without `check` the blocked draws stay in
    the program, for that check to find them in the density's jaxpr."""
    tags = _RUN_TAGS + also + ((BLOCKED,) if check else ())
    try:
        reaped = _walked(f, tags, observed, u, _key(), args, kwargs)
    except KeyError as error:  # a name in `u` with no `u` site: say which kind it is
        free, sites = jax.eval_shape(
            Partial(_draws_and_sites, f, observed), _key(), *args, **kwargs
        )
        unknown = set(leaf_paths(u)) - set(leaf_paths(sites))
        discrete = unknown & set(leaf_paths(free))
        if discrete:
            raise _discrete_free(sorted(discrete)) from error
        raise _not_free(sorted(unknown)) from error
    free, unplanted, jacobians, markers, in_scan = (reaped.get(tag, {}) for tag in _RUN_TAGS)
    if check and reaped.get(BLOCKED):
        score = Partial(_log_density, f, observed, False)
        check_blocked_unscored(score, (u, *args), kwargs, "unconstrained")
    free_names = set(leaf_paths(free))
    given = set(leaf_paths(u))
    if given - free_names:
        raise _not_free(sorted(given - free_names))
    missing = free_names - given
    continuous = set(leaf_paths(unplanted))
    if missing & continuous:
        raise ValueError(
            f"unconstrained: no value for {', '.join(sorted(missing & continuous))}. Give every free random variable "
            "(init(key) gives a starting point)."
        )
    enumerated = supports(markers, missing, in_scan)
    if missing - set(enumerated):
        raise _discrete_free(sorted(missing - set(enumerated)))
    log_det = sum(jnp.sum(j) for js in at_paths(jacobians, free_names) for j in js)
    kept = restricted(free, free_names - set(enumerated))
    found = {t: reaped.get(t, {}) for t in also}
    return kept, jnp.asarray(log_det, jnp.float32), enumerated, found


def _log_density(
    f: Callable[..., Any], observed: Reaped, check: bool, u: Reaped, *args: Any, **kwargs: Any
) -> Any:
    if _jax.staged_beneath():  # the outer jit is the cache: a walk would only re-bind the program
        return _density(f, observed, check, u, args, kwargs)
    return reap(Partial(_total, f, observed, check), tag=TOTAL)(u, *args, **kwargs)["total"]


def _total(
    f: Callable[..., Any], observed: Reaped, check: bool, u: Reaped, *args: Any, **kwargs: Any
) -> None:
    """Sows the log density of `u` (called eagerly, the core traces this once per signature)."""
    sow(_density(f, observed, check, u, args, kwargs), tag=TOTAL, name="total", mode="strict")


def _density(
    f: Callable[..., Any], observed: Reaped, check: bool, u: Reaped, args: Any, kwargs: Any
) -> Any:
    """The log density of `u`, with the enumerated draws summed out. No draw is sampled
    (the scoring switch): each value is made from `u`, planted, summed out or hidden by `block`."""
    with scoring():
        return _scored(f, observed, check, u, args, kwargs)


def _scored(
    f: Callable[..., Any], observed: Reaped, check: bool, u: Reaped, args: Any, kwargs: Any
) -> Any:
    _, log_det, enumerated, found = _run(f, observed, check, (LOG_DENSITY,), u, *args, **kwargs)
    if enumerated:

        def densities_at(values: Reaped) -> Reaped:
            at = merged(observed, values)
            _, log_det, _, found = _run(f, at, False, (LOG_DENSITY,), u, *args, **kwargs)
            return {**found[LOG_DENSITY], TOTAL: log_det}

        total = marginal(densities_at, enumerated)
    else:
        total = sum(densities_of(found[LOG_DENSITY])) + log_det
    return total


def discrete_draw(
    f: Callable[..., Any], observed: Reaped, u: Reaped, key: Any, *args: Any, **kwargs: Any
) -> Reaped:
    """The enumerated draws of `f`, drawn from their posterior given `observed` and the
    free continuous draws at `u` (`infer_discrete`)."""
    with scoring():
        _, _, enumerated, _ = _run(f, observed, True, (), u, *args, **kwargs)
        if not enumerated:
            raise ValueError(
                "infer_discrete: the program has no free enumerated draw to infer. Mark a discrete "
                "draw with random_variable(..., enumerate=True) (and leave it out of `observed`)."
            )

        def densities_at(values: Reaped) -> Reaped:
            at = merged(observed, values)
            _, log_det, _, found = _run(f, at, False, (LOG_DENSITY,), u, *args, **kwargs)
            return {**found[LOG_DENSITY], TOTAL: log_det}

        return draw(densities_at, enumerated, key)


def _constrain(
    f: Callable[..., Any], observed: Reaped, u: Reaped, *args: Any, **kwargs: Any
) -> Reaped:
    free, _, _, found = _run(f, observed, False, (DETERMINISTIC,), u, *args, **kwargs)
    return {**free, **found[DETERMINISTIC]}


def site_log_densities(
    f: Callable[..., Any], observed: Reaped, u: Reaped, *args: Any, **kwargs: Any
) -> dict[str, jax.Array]:
    """`{name: summed log density}` of each site at `u`, and the log-Jacobian of the free
    draws as `"log |det J|"`: what a non-finite total is made of."""
    _, log_det, _, found = _run(f, observed, False, (LOG_DENSITY,), u, *args, **kwargs)
    densities = found[LOG_DENSITY]
    sums: dict[str, jax.Array] = {
        name: jnp.asarray(sum(densities_of({name: at_paths(densities, {name})[0]})))
        for name in leaf_paths(densities)
    }
    return {**sums, "log |det J|": log_det}


def _check_finite(observed: Reaped) -> None:
    """Refuses a NaN or infinite observation, as NumPyro does: the density would be NaN
    at every `u`, and a sampler would stay at its start with every step divergent."""
    for name in leaf_paths(observed):
        for leaf in jax.tree_util.tree_leaves(at_paths(observed, {name})[0]):
            if isinstance(leaf, jax.core.Tracer):  # inside the user's jit: not known here
                continue
            if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                continue
            value = np.asarray(leaf)
            if value.dtype.kind not in "fc" or np.isfinite(value).all():
                continue
            bad = np.argwhere(~np.isfinite(value))
            first = tuple(int(i) for i in bad[0])
            raise ValueError(
                f"unconstrained/sample_posterior: the observed value of {name!r} has {len(bad)} "
                "non-finite element(s) of "
                f"{value.size} (the first at index {first}). A NaN or infinite observation makes the log "
                "density NaN everywhere, so a sampler cannot move. Leave missing observations out of "
                "the observed site (observe only the entries you have), or model them as free draws."
            )


# How many prior draws `init` makes before giving up on a finite density (NumPyro's 100).
INIT_ATTEMPTS = 100


def _init(f: Callable[..., Any], observed: Reaped, key: Any, *args: Any, **kwargs: Any) -> Reaped:
    """A prior draw of the free draws' `u` where the log density is finite: the first of
    up to `INIT_ATTEMPTS` (keys folded from `key`), or the last tried."""
    _check_movable(f, observed, key, args, kwargs)

    def draw(k: Any) -> Reaped:
        free, sites = _draws_and_sites(f, observed, k, *args, **kwargs)
        return restricted(sites, set(leaf_paths(free)))

    first = draw(key)
    if not first:
        return first

    def finite(u: Reaped) -> jax.Array:
        ok: jax.Array = jnp.isfinite(_density(f, observed, False, u, args, kwargs))
        return ok

    def looking(carry: tuple[Any, Reaped, jax.Array]) -> jax.Array:
        attempt, _, ok = carry
        more: jax.Array = (attempt < INIT_ATTEMPTS) & ~ok
        return more

    def another(carry: tuple[Any, Reaped, jax.Array]) -> tuple[Any, Reaped, jax.Array]:
        attempt, _, _ = carry
        u = draw(jax.random.fold_in(key, attempt))
        return attempt + 1, u, finite(u)

    start: Reaped = jax.lax.while_loop(looking, another, (1, first, finite(first)))[1]
    return start


def _check_movable(
    f: Callable[..., Any], observed: Reaped, key: Any, args: Any, kwargs: Any
) -> None:
    """Raises, naming them, if a free draw cannot be moved to R^n: drawn by a plain
    sampling function (no density), or discrete and not enumerated."""
    tags = (RANDOM_VARIABLE, UNCONSTRAINED, ENUMERATED, LOG_DENSITY)
    reaped = jax.eval_shape(lambda k: _walked(f, tags, observed, {}, k, args, kwargs), key)
    free, sites, markers, densities = (set(leaf_paths(reaped.get(t, {}))) for t in tags)
    stuck = free - sites - markers
    if stuck - densities:
        raise _errors.drawn_without_density("unconstrained", stuck - densities)
    if stuck:
        raise _discrete_free(sorted(stuck))


def _draws_and_sites(
    f: Callable[..., Any], observed: Reaped, key: Any, *args: Any, **kwargs: Any
) -> tuple[Reaped, Reaped]:
    """The free draws of `f` and its `u` sites (free or not), from a prior draw."""
    reaped = _walked(f, (RANDOM_VARIABLE, UNCONSTRAINED), observed, {}, key, args, kwargs)
    return reaped.get(RANDOM_VARIABLE, {}), reaped.get(UNCONSTRAINED, {})


@dataclasses.dataclass(frozen=True)
class Unconstrained:
    """A program's density over unconstrained values `u` (a dict, one entry per free variable).

    `log_density(u, *args)`: the log density of `u`, including the Jacobian of
    each variable's map onto its support. `constrain(u, *args)`: the model's
    values `{name: value}` for `u`: the free variables and every
    `deterministic` site (observed and fixed ones are not random).
    `init(key, *args)`: a `u` drawn from the prior, to start a chain (redrawn, up to
    100 times, until the log density there is finite).

    Attributes:
        log_density: ``log_density(u, *args) -> scalar``, the Jacobian included.
        constrain: ``constrain(u, *args) -> {name: value}``, the free draws and
            ``deterministic`` sites.
        init: ``init(key, *args) -> u``, drawn from the prior where the log density is
            finite; raises, naming it, for a free draw that cannot be moved to R^n.

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


@model_was_f
def unconstrained(
    model: Callable[..., Any], observed: Mapping[str, Any] | None = None
) -> Unconstrained:
    """Returns the `Unconstrained` density of the program `model`, with `observed` values fixed.

    Every TFP-distributed random variable not in `observed` becomes free and is
    moved to R^n by its distribution's default event-space bijector (softplus
    for a positive scale, sigmoid for a probability, the identity for a normal);
    the log density adds the log-Jacobian of that map. `observed` (a dict
    `{name: value}`) is scored at its value. Feed `log_density` to `tfp.mcmc`'s
    HMC or NUTS (or any gradient-based sampler) and map the chain back with
    `jax.vmap(constrain)`. Scoped (`nest`) variables are matched in `observed`
    by their own name.

    Args:
        model: the probabilistic program ``model(key, *args)``.
        observed: values of random variables to fix and score, ``{name: value}`` (None: none).

    Returns:
        The ``Unconstrained`` density over the free variables.

    Raises:
        TypeError: if a key of ``observed`` is not a string.
        ValueError: if an observed value holds a NaN or an infinity.

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
    _check_finite(observed)
    return Unconstrained(
        Partial(_log_density, model, observed, True),
        Partial(_constrain, model, observed),
        Partial(_init, model, observed),
    )
