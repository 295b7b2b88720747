"""`block`: hide random variables from every transformation, and what scoring makes of them.

A blocked draw is still drawn, but the transformations outside no longer
see it: its `RANDOM_VARIABLE` sow is planted by a callable that re-sows the
value under `BLOCKED` (so the hidden draw stays findable in a jaxpr), and its
log density is dropped.

Scoring a program (`joint_log_prob`, `unconstrained`) marginalises a blocked
draw, as NumPyro's `block` hides a site from the density and oryx's
`log_prob` integrates out a draw the output does not determine. That is
exact when no density that is counted depends on the draw: its own density
integrates to one. When one does (a blocked latent upstream of a scored
draw), the marginal is an integral harvest does not compute, and scoring at
the draw's placeholder-key value would be silently wrong, so it is an
error naming the draw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax

from .._calling._tracing import make_jaxpr
from .._calling._transforms import harvest_tags
from .._jax import sub_jaxprs
from .._typing import P, R
from .._walk._paths import path_str
from .._walk._primitive import sow_p
from .._walk._site import Site
from .._walk._sow import sow
from .._walk._sow_index import sites_in
from . import _errors
from ._inverse import inline_calls, live_vars
from ._names import Among, AmongUnderAnyTag, check_drawn
from ._old_spellings import model_was_f
from ._tags import BLOCKED, LOG_DENSITY, RANDOM_VARIABLE


@model_was_f
def block(model: Callable[P, R], names: str | Iterable[str]) -> Callable[P, R]:
    """Returns ``model`` with the random variables ``names`` hidden from every transformation.

    The blocked variables are still drawn, but ``joint_sample``, ``intervene``,
    ``trace``... of the result no longer see them, as if ``model`` drew them with
    plain ``jax.random`` calls. ``joint_log_prob`` and ``unconstrained`` of the
    result marginalise them: exact when no counted density depends on a
    blocked draw (a blocked observation, say); otherwise they raise, since the
    marginal is an integral harvest does not compute.

    Args:
        model: the program ``model(key, *args)``.
        names: the random variables to hide: a name, or a list of names
            (scoped names dotted, ``"scope.x"``).

    Returns:
        The program with the same signature and the named draws hidden.

    Raises:
        TypeError: if a name is not a non-empty string.
        KeyError: (when the result is called) if a name is not a random
            variable of ``model``.

    Example:
        >>> import jax
        >>> import harvest.ppl as ppl
        >>> import tensorflow_probability.substrates.jax as tfp
        >>> tfd = tfp.distributions
        >>> def model(key):
        ...     k1, k2 = jax.random.split(key)
        ...     z = ppl.random_variable(tfd.Normal(0.0, 1.0), name="z")(k1)
        ...     return ppl.random_variable(tfd.Normal(z, 1.0), name="x")(k2)
        >>> list(ppl.joint_sample(ppl.block(model, ["x"]))(jax.random.key(0)))
        ['z']
        >>> ppl.joint_log_prob(ppl.block(model, "x"))({"z": 0.0})  # x integrated out
        Array(-0.9189385, dtype=float32)
    """
    names = [names] if isinstance(names, str) else list(names)
    if not all(isinstance(n, str) and n for n in names):
        raise _errors.names_not_strings("block", "random variable names", names)
    return jax.tree_util.Partial(_blocked, model, Among(frozenset(names)))


@dataclasses.dataclass(frozen=True)
class _Hide:
    """The plant that hides the draw `name`: its value, re-sown under `BLOCKED`."""

    name: str

    def __call__(self, value: Any) -> Any:
        return sow(value, tag=BLOCKED, name=self.name, mode="collect")


def _blocked(f: Callable[..., Any], names: Among, *args: Any, **kwargs: Any) -> Any:
    plants = {name: _Hide(name) for name in sorted(names.names)}
    return with_draws_replaced(f, names.names, plants, names.names, "block", args, kwargs)


def with_draws_replaced(
    f: Callable[..., Any],
    names: frozenset[str],
    plants: Any,
    requested: Any,
    caller: str,
    args: Any,
    kwargs: Any,
) -> Any:
    """`f`'s output, from one walk that plants `plants` at the random variables
    `names` and drops their log densities (reaped, then thrown away). A name in
    `requested` that `f` does not draw is an error naming `caller`."""
    walk = harvest_tags(f, (RANDOM_VARIABLE, LOG_DENSITY), AmongUnderAnyTag(names))
    try:
        return walk({RANDOM_VARIABLE: plants} if plants else {}, *args, **kwargs)[0]
    except KeyError:
        check_drawn(caller, f, requested, args, kwargs)
        raise


def check_blocked_unscored(
    score: Callable[..., Any],
    score_args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fn_name: str,
) -> None:
    """Raises if `score(*score_args, **kwargs)` depends on a draw that `block` hid.

    Call it only when the program holds a blocked draw (a reap of `BLOCKED`
    found one): it traces `score` and checks its dependence on each blocked value.
    """
    scored, _, _ = make_jaxpr(score, score_args, kwargs, return_shape=True)
    jaxpr = inline_calls(scored).jaxpr
    live = live_vars(jaxpr)
    needed: set[str] = set()
    for eqn in jaxpr.eqns:
        if not any(v in live for v in eqn.outvars):
            continue
        if eqn.primitive is sow_p and eqn.params["tag"] == BLOCKED:
            needed.add(path_str(Site.of(eqn).path))
        else:
            # A loop or branch holding a blocked draw: assume the worst.
            for sub in sub_jaxprs(eqn):
                needed |= {path_str(s.path) for s in sites_in(sub) if s.tag == BLOCKED}
    if needed:
        raise ValueError(
            f"{fn_name}: the density depends on {', '.join(sorted(needed))}, hidden by block. A blocked "
            "draw is integrated out, which harvest can do only where no counted density depends "
            "on it. Fix it with intervene or conditional, or do not block it."
        )
