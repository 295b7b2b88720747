"""The transformations of probabilistic programs: sample, score, fix.

A probabilistic program is a function `f(key, *args)` whose draws are made
with `random_variable`. Every transformation here is `reap`, `plant` or
`harvest` of the two tags that `random_variable` sows (see
`_random_variable.py`):

* `joint_sample` reaps the samples;
* `joint_log_prob` plants every sample and reaps the log densities;
* `intervene` / `conditional` plant some samples and drop their log
  densities, so the fixed variables are no longer random.

Scoring needs no randomness, so the score functions trace `f` with a
placeholder key, as oryx does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend.core import Literal
from jax.tree_util import Partial

from .._primitive import sow_p, tracing_for_harvest
from .._site import Site
from .._transforms import call_and_reap, harvest, plant, reap
from ._random_variable import LOG_DENSITY, RANDOM_VARIABLE, is_distribution


def _placeholder_key():
    return jax.random.PRNGKey(0)


def _dotted_paths(tree, prefix=()):
    """Every key path of a nested dict, as dotted names ("scope.x")."""
    paths = set()
    for key, value in tree.items():
        path = prefix + (key,)
        paths.add(".".join(path))
        if isinstance(value, dict):
            paths |= _dotted_paths(value, path)
    return paths


def _leaf_paths(tree, prefix=()):
    """The dotted names of a nested dict's non-dict entries."""
    out = []
    for key, value in tree.items():
        path = prefix + (key,)
        out += _leaf_paths(value, path) if isinstance(value, dict) else [".".join(path)]
    return out


def _check_values(values, fn_name):
    if not isinstance(values, dict):
        raise TypeError(
            f"{fn_name} takes the values of random variables as a dict {{name: value}} "
            f"(as joint_sample returns it), got a {type(values).__name__}."
        )


def joint_sample(f):
    """Returns a program `(key, *args) -> {name: value}` with every draw of `f`.

    Names put under a scope by `nest` come back as nested dicts; draws of mode
    `"append"` come back stacked on a leading axis.

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
    return reap(f, tag=RANDOM_VARIABLE)


def _unscored(values, densities):
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


def _densities(f, values, *args, **kwargs):
    """Runs `f` with every random variable planted from `values`."""
    out, unplanted = harvest(f, tag=RANDOM_VARIABLE)(values, _placeholder_key(), *args, **kwargs)
    if unplanted:
        raise ValueError(
            "joint_log_prob needs a value for every random variable; missing: "
            f"{', '.join(sorted(_leaf_paths(unplanted)))}. Give them too, or fix them "
            "first with intervene/conditional."
        )
    return out


def _joint_log_prob(f, values, *args, **kwargs):
    _check_values(values, "joint_log_prob(f)")
    densities = reap(Partial(_densities, f), tag=LOG_DENSITY)(values, *args, **kwargs)
    unscored = _unscored(values, densities)
    if unscored:
        raise ValueError(
            f"joint_log_prob: the random variables {', '.join(sorted(unscored))} were "
            "drawn by plain sampling functions, which have no density. Draw them from "
            "a TFP distribution, or fix them with intervene/conditional."
        )
    return sum(jnp.sum(d) for d in jax.tree_util.tree_leaves(densities))


def joint_log_prob(f):
    """Returns `log_density({name: value}, *args) -> scalar` for the program `f`.

    It is the sum of every random variable's log density at the given values,
    so every random variable of `f` needs a value. The function is
    differentiable in the values and works under `jit` and `vmap`.

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
    return Partial(_joint_log_prob, f)


@dataclasses.dataclass(frozen=True)
class _Among:
    """An allowlist predicate that compares by value, so equal name sets share
    one entry of the core's cache."""

    names: frozenset

    def __call__(self, name):
        return name in self.names


def _plant_values(f, chosen, values, *args, **kwargs):
    return plant(f, tag=RANDOM_VARIABLE, allowlist=chosen)(values, *args, **kwargs)


def _fixed(f, names, values, *args, **kwargs):
    """`f` with the random variables `names` set to `values` and their log
    densities dropped (reaped and thrown away)."""
    chosen = _Among(names)
    try:
        planted = Partial(_plant_values, f, chosen)
        return call_and_reap(planted, tag=LOG_DENSITY, allowlist=chosen)(values, *args, **kwargs)[0]
    except KeyError as error:
        known = jax.eval_shape(joint_sample(f), *args, **kwargs)
        unknown = sorted(set(_leaf_paths(values)) - set(_leaf_paths(known)))
        if not unknown:
            raise
        raise KeyError(
            f"Not random variables of the program: {', '.join(unknown)}. Its random "
            f"variables are: {', '.join(sorted(_leaf_paths(known))) or 'none'}."
        ) from error


def intervene(f, **values):
    """The do-operator: `f` with the named random variables set to `values`.

    Everything downstream of an intervened variable uses its value, and the
    variable is no longer random: `joint_sample` leaves it out and
    `joint_log_prob` neither asks for it nor counts its density. Other random
    variables are unaffected. Give a scoped (`nest`) variable as a nested dict.

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
    return Partial(_fixed, f, frozenset(_dotted_paths(values)), values)


def _nested(names, values):
    out = {}
    for name, value in zip(names, values):
        *scopes, leaf = name.split(".")
        d = out
        for scope in scopes:
            d = d.setdefault(scope, {})
        d[leaf] = value
    return out


def conditional(f, names):
    """Returns a program that takes the values of the random variables `names` as inputs.

    The new program is called as `g(key, *args, *values)`: the values of
    `names`, in order, come after `f`'s own arguments (as in oryx). A single
    name may be given as a string. Scoped names are dotted (`"scope.x"`). As
    with `intervene`, the given variables are no longer random.

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
        >>> given(jax.random.key(0), 1.0, 2.0)
        Array(2., dtype=float32, weak_type=True)
        >>> ppl.joint_log_prob(ppl.conditional(model, "z"))({"x": 0.0}, 0.0)
        Array(-0.9189385, dtype=float32)
    """
    names = [names] if isinstance(names, str) else list(names)
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"conditional takes random variable names as strings, got {names!r}.")
    if not names:
        return f
    return Partial(_conditioned, f, tuple(names))


def _conditioned(f, names, *args, **kwargs):
    if len(args) < len(names):
        raise TypeError(
            f"conditional(f, {list(names)}) is called as g(key, *args, *values) with one "
            f"value per name; got {len(args)} positional arguments in all."
        )
    split = len(args) - len(names)
    values = _nested(names, args[split:])
    return _fixed(f, frozenset(_dotted_paths(_nested(names, names))), values, *args[:split], **kwargs)


# ---------------------------------------------------------------------------
# log_prob: which random variables is a program's output?

_CALL_PRIMITIVES = ("jit", "pjit", "closed_call", "core_call", "checkpoint", "remat")


def _inner_jaxpr(eqn):
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return getattr(inner, "jaxpr", inner)


def _origin(jaxpr, var):
    """Where `var` comes from: ("rv", site, leaf index), ("input", index), or None.

    Follows identities only: sows of other tags and calls whose body passes
    the value through. Anything computed from a draw is not the draw.
    """
    if isinstance(var, Literal):
        return None
    if var in jaxpr.invars:
        return ("input", jaxpr.invars.index(var))
    eqn = next(e for e in jaxpr.eqns if var in e.outvars)
    i = eqn.outvars.index(var)
    if eqn.primitive is sow_p:
        site = Site.of(eqn)
        return ("rv", site, i) if site.tag == RANDOM_VARIABLE else _origin(jaxpr, eqn.invars[i])
    if eqn.primitive.name in _CALL_PRIMITIVES:
        inner = _inner_jaxpr(eqn)
        found = _origin(inner, inner.outvars[i])
        if found and found[0] == "input":
            return _origin(jaxpr, eqn.invars[found[1]])
        return found
    return None


def _output_as_values(f, value, args, kwargs):
    """The `{name: value}` that `f`'s output `value` spells, or a clear error."""
    with tracing_for_harvest():
        closed = jax.make_jaxpr(f)(_placeholder_key(), *args, **kwargs)
    origins = [_origin(closed.jaxpr, v) for v in closed.jaxpr.outvars]
    leaves = jax.tree_util.tree_leaves(value)
    if len(leaves) != len(origins) or any(o is None or o[0] != "rv" for o in origins):
        raise ValueError(
            "log_prob(f) needs f to return its random variables themselves (as drawn by "
            "random_variable); f returns something computed from them or from its inputs, "
            "and harvest.ppl does not invert computations. Use joint_log_prob(f) with a "
            "value for each random variable instead."
        )
    by_site: dict = {}
    for (_, site, i), leaf in zip(origins, leaves):
        by_site.setdefault(site, {})[i] = leaf
    values = {}
    for site, parts in by_site.items():
        d = values
        for scope in site.name[:-1]:
            d = d.setdefault(scope, {})
        d[site.name[-1]] = jax.tree_util.tree_unflatten(site.tree, [parts[i] for i in sorted(parts)])
    return values


def log_prob(f):
    """Returns `log_density(value, *args)` of a distribution or of a program's output.

    For a TFP distribution this is its own `log_prob`. For a program, it is
    defined when the program returns its random variables themselves (one, or
    a pytree of them) and has no other random variables; the density is then
    `joint_log_prob` at those values. A program that transforms its draws, or
    draws latent variables it does not return, is an error: use
    `joint_log_prob`.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def pair(key):
        ...     k1, k2 = jax.random.split(key)
        ...     a = ppl.random_variable(tfd.Normal(0.0, 1.0), name="a")(k1)
        ...     return a, ppl.random_variable(tfd.Normal(a, 1.0), name="b")(k2)
        >>> ppl.log_prob(pair)((0.0, 0.0))
        Array(-1.837877, dtype=float32)
    """
    if is_distribution(f):
        return f.log_prob
    if not callable(f):
        raise TypeError(f"log_prob takes a TFP distribution or a program, got a {type(f).__name__}.")
    return Partial(_log_prob, f)


def _log_prob(f, value, *args, **kwargs):
    values = _output_as_values(f, value, args, kwargs)
    known = jax.eval_shape(joint_sample(f), _placeholder_key(), *args, **kwargs)
    latent = sorted(set(_leaf_paths(known)) - set(_leaf_paths(values)))
    if latent:
        raise ValueError(
            f"log_prob(f) is not defined: f also draws {', '.join(latent)}, which its "
            "output does not contain. Use joint_log_prob(f) with values for all random "
            "variables, or return them from f."
        )
    return _joint_log_prob(f, values, *args, **kwargs)
