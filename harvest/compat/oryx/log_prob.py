"""oryx.core.interpreters.log_prob's registry: densities for your own sampling primitives.

As in oryx, a primitive `p` whose output is a random draw is given a density
by `log_prob_registry.add(p)` and a rule in `log_prob_rules[p]`. The rule is
called as `rule(incells, outcells, **params)` and returns
`(incells, outcells, log_prob)`, or `log_prob=None` when it cannot score the
draw; each cell has `.val` (None when unknown), `.aval` and `.top()` (whether
the value is known). `harvest.compat.oryx.ppl.log_prob` inverts the program
back to each registered draw and calls its rule.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.extend.core import Primitive
    >>> from harvest.compat.oryx import log_prob as lp, ppl
    >>> import tensorflow_probability.substrates.jax as tfp
    >>> uniform_p = Primitive("my_uniform")
    >>> _ = uniform_p.def_impl(lambda key: jax.random.uniform(key))
    >>> _ = uniform_p.def_abstract_eval(lambda key: jax.core.ShapedArray((), jnp.float32))
    >>> def uniform_rule(incells, outcells):
    ...     (out,) = outcells
    ...     lp_ = tfp.distributions.Uniform().log_prob(out.val) if out.top() else None
    ...     return incells, outcells, lp_
    >>> lp.log_prob_rules[uniform_p] = uniform_rule
    >>> lp.log_prob_registry.add(uniform_p)
    >>> ppl.log_prob(lambda key: 2.0 * uniform_p.bind(key))(1.0)
    Array(-0.6931472, dtype=float32)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

__all__ = ["LogProbRules", "log_prob_registry", "log_prob_rules", "registered"]


class LogProbRules(dict[Any, Callable[..., Any]]):
    """{primitive: rule(incells, outcells, **params) -> (incells, outcells, log_prob)}."""


log_prob_rules = LogProbRules()

# The primitives whose outputs are draws with a density (`log_prob_rules` scores them).
log_prob_registry: set[Any] = set()


@dataclasses.dataclass
class Cell:
    """What the inverse walk knows about one value, as oryx's rules read it."""

    aval: Any
    val: Any = None
    ildj: Any = 0.0

    def top(self) -> bool:
        return self.val is not None

    def bottom(self) -> bool:
        return self.val is None

    def is_unknown(self) -> bool:
        return self.val is None


def _cell(var: Any, known: Any) -> Cell:
    if not known.has(var):
        return Cell(var.aval)
    return Cell(var.aval, jnp.asarray(known.get(var)), known.ildj_of(var))


def _density(eqn: Any, known: Any) -> Any:
    rule = log_prob_rules.get(eqn.primitive)
    if rule is None:
        raise KeyError(
            f"`{eqn.primitive}` is in log_prob_registry but has no rule in log_prob_rules; "
            "add one: log_prob_rules[primitive] = rule(incells, outcells, **params)."
        )
    incells = [_cell(v, known) for v in eqn.invars]
    outcells = [_cell(v, known) for v in eqn.outvars]
    return rule(incells, outcells, **eqn.params)[2]


def registered() -> dict[Any, Callable[[Any, Any], Any]]:
    """The registry as the inverse walk takes it: ``{primitive: density(eqn, known)}``.

    Returns:
        A dict from each primitive in ``log_prob_registry`` to a function that
        scores one of its equations with the rule in ``log_prob_rules``.

    Example:
        >>> from harvest.compat.oryx import log_prob as lp
        >>> set(lp.registered()) == lp.log_prob_registry
        True
    """
    return {p: _density for p in log_prob_registry}
