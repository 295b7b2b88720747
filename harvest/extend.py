"""Teaching harvest a higher-order primitive it does not know.

A sow inside a primitive that holds a jaxpr (a body) is reached only if
harvest has two things for that primitive:

* a **descriptor** (``HigherOrder``): its bodies with their labels and how
  many times each runs per call, and how it forwards and re-stages. ``sites``,
  occurrence counting, the sweeps, op sites, batched conds and the PPL
  evaluators read it; and
* a **rule**: what the reap/plant walk does at an equation of it, written
  with ``walk_in_place`` (the body evaluated where the equation stood, as if
  inlined) and ``retrace`` (the body re-traced with its records as extra
  outputs, to bind the primitive again around it).

``register`` installs both. Without them, a sow there raises an error naming
the primitive. ``jax.custom_batching.custom_vmap`` is supported through this
module (``harvest/_rules/custom_vmap.py``, the worked example in
CONTRIBUTING.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import _jax
from ._higher_order import UNBOUNDED as UNBOUNDED, Body as Body, HigherOrder as HigherOrder, declare
from ._interpreter import RULES, Retraced as Retraced, Walk as Walk, interpret, retrace as _retrace

Rule = Callable[[Walk, Any, list[Any]], list[Any]]


def register(primitive: _jax.Primitive, descriptor: HigherOrder, rule: Rule) -> None:
    """Registers what harvest knows about ``primitive`` and how its walk handles it.

    Args:
        primitive: The JAX primitive (a ``Primitive`` of JAX's extension API) whose
            equations hold a body.
        descriptor: Its ``HigherOrder`` descriptor: ``bodies(eqn)`` returns one
            ``Body`` per jaxpr the equation runs (its label, how many times it
            runs per run of the equation), plus the optional facts the
            descriptor's fields list.
        rule: ``rule(walk, eqn, invals) -> outputs`` (a list), run where the
            walk meets an equation of ``primitive`` whose body holds a sow it
            handles; build it from ``walk_in_place``, ``retrace`` and
            ``plants_inside``.

    Raises:
        TypeError: ``descriptor`` is not a ``HigherOrder``, or ``rule`` is not callable.

    Example:
        >>> import jax
        >>> from jax.extend.core import Primitive, jaxpr_as_fun
        >>> from harvest import reap, sites, sow, extend
        >>> twice_p = Primitive("twice")  # runs its body twice in a row
        >>> twice_p.multiple_results = True
        >>> _ = twice_p.def_impl(lambda x, *, body: jaxpr_as_fun(body)(*jaxpr_as_fun(body)(x)))
        >>> _ = twice_p.def_abstract_eval(lambda x, *, body: [x])
        >>> def twice(f, x):
        ...     return twice_p.bind(x, body=jax.make_jaxpr(f)(x))[0]
        >>> def walk_twice(walk, eqn, invals):
        ...     body = eqn.params["body"]
        ...     once = extend.walk_in_place(walk, body.jaxpr, body.consts, invals)
        ...     return extend.walk_in_place(walk, body.jaxpr, body.consts, once)
        >>> extend.register(
        ...     twice_p,
        ...     extend.HigherOrder(lambda eqn: [extend.Body("twice", eqn.params["body"].jaxpr, runs=2)]),
        ...     walk_twice,
        ... )
        >>> f = lambda x: twice(lambda y: sow(y + 1.0, name="h", mode="append"), x)
        >>> reap(f)(1.0)["h"]
        Array([2., 3.], dtype=float32, weak_type=True)
        >>> [(s.name, s.fires, s.where) for s in sites(f, 1.0)]
        [('h', 2, 'twice')]
    """
    if not isinstance(descriptor, HigherOrder):
        raise TypeError(
            f"harvest.extend.register: descriptor must be a harvest.extend.HigherOrder, got "
            f"{type(descriptor).__name__}."
        )
    if not callable(rule):
        raise TypeError(f"harvest.extend.register: rule must be callable, got {rule!r}.")
    declare(primitive)(descriptor)
    RULES[primitive] = rule


def walk_in_place(
    walk: Walk, jaxpr: _jax.Jaxpr, consts: Sequence[Any], args: Sequence[Any]
) -> list[Any]:
    """Evaluates ``jaxpr`` with ``walk``, where the equation holding it stood (as if inlined).

    Its sows are planted and reaped by ``walk`` itself, in order with the rest
    of the program; the primitive around the body is not bound again (what it
    adds, a derivative rule, say, is dropped for this call).

    Args:
        walk: The walk the rule was given.
        jaxpr: The body (an open jaxpr, e.g. ``closed.jaxpr``).
        consts: Values for its constvars (``closed.consts``).
        args: Values for its invars.

    Returns:
        The body's outputs, a list.

    Example:
        >>> from harvest import extend
        >>> callable(extend.walk_in_place)
        True
    """
    outs: list[Any] = interpret(walk, jaxpr, consts, list(args))
    return outs


def retrace(walk: Walk, jaxpr: _jax.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> Retraced:
    """Re-traces ``jaxpr`` through a child of ``walk`` into a new jaxpr that also returns its records.

    Bind the primitive again around ``result.jaxpr`` (it takes
    ``result.num_consts`` closed-over values, then the body's inputs, and
    returns the body's ``result.num_outs`` outputs, then the records), calling
    it on ``result.args``; then ``result.finish(walk, outputs)`` folds the
    records into ``walk`` and returns the body's own outputs.

    Args:
        walk: The walk the rule was given.
        jaxpr: The body (an open jaxpr).
        consts: Values for its constvars.
        args: Values for its invars (their shapes and dtypes are traced).

    Returns:
        A ``Retraced``: ``jaxpr``, ``args``, ``num_consts``, ``num_outs`` and ``finish``.

    Example:
        >>> from harvest import extend
        >>> callable(extend.retrace)
        True
    """
    result: Retraced = _retrace(walk, jaxpr, consts, list(args))
    return result


def plants_inside(walk: Walk, jaxprs: Sequence[_jax.Jaxpr]) -> bool:
    """Whether ``walk`` plants a value at a sow inside ``jaxprs``.

    A rule that keeps a rule of its primitive (a derivative, a batching rule)
    for reaping usually inlines the body instead when it plants there: the
    planted body is no longer the function the primitive's rule describes.

    Args:
        walk: The walk the rule was given.
        jaxprs: The bodies to look in (open jaxprs).

    Returns:
        True if a sow there is planted by this walk.

    Example:
        >>> from harvest import extend
        >>> callable(extend.plants_inside)
        True
    """
    return bool(walk.plants_inside(list(jaxprs)))
