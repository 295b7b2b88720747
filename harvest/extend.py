"""Teaching harvest a higher-order primitive it does not know.

A sow inside a primitive that holds a jaxpr (a body) is reached only if
harvest has two things for that primitive, installed in one object by
``register(p, HigherOrder(bodies, rule=...))`` (without them, a sow there
raises an error naming the primitive):

* a **descriptor** (``HigherOrder``): its bodies with their labels and how
  many times each runs per call, and how it forwards and re-stages, read by
  ``sites``, occurrence counting, the sweeps, op sites, batched conds and the
  PPL evaluators; and
* a **rule**: what the reap/plant walk does at an equation of it, written
  with ``walk_in_place`` (the body evaluated where the equation stood, as if
  inlined) and ``retrace`` (the body re-traced with its records as extra
  outputs, to bind the primitive again around it with ``Retraced.rebind``).

``retrace`` and ``Retraced.rebind`` fit **call-like** primitives: one body that
runs once on the equation's inputs and gives its outputs, and no other param
that counts them. A loop, a branch or a body with another calling convention
needs a rule of its own (``harvest/_walk/_rules/loops.py`` has scan's), or
``walk_in_place`` where inlining keeps the meaning. ``jax.custom_batching.custom_vmap``
is supported through this module (``harvest/_walk/_rules/custom_vmap.py``, the
worked example in CONTRIBUTING.md). A re-traced body takes its closed-over
values as its leading inputs, so a param that held a ``ClosedJaxpr`` takes
``ClosedJaxpr(result.jaxpr, ())`` (JAX's, from its ``extend.core``);
``Retraced.rebind`` does that for a call-like primitive.

**Inside a cond that vmap batches** (its predicate differs per example), JAX
runs every branch on every example, so a sow there must carry its value out of
the branch for harvest to keep the taken branch's. Harvest inlines the body of
a call-like primitive (``call=True``, no ``custom_rule``) there. Any other
primitive needs the descriptor's ``batched_branch(eqn, invals, found, stuck) ->
outputs``, which evaluates the equation on ``invals`` with each body run
through ``walk_in_branch(jaxpr, consts, args, found, stuck)``. Without it, a
sow there still takes plants, and reaping it is an error naming the primitive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

from . import _jax
from ._walk._higher_order import (
    UNBOUNDED as UNBOUNDED,
    Body as Body,
    HigherOrder as HigherOrder,
    register as _register,
)
from ._walk._interpreter import (
    Retraced as Retraced,
    Walk as Walk,
    interpret as _interpret,
    retrace as _retrace,
)
from ._walk._rules.batched_cond import rewrite as _rewrite

__all__ = [
    "UNBOUNDED",
    "Body",
    "HigherOrder",
    "Retraced",
    "Rule",
    "Walk",
    "plants_inside",
    "register",
    "retrace",
    "walk_in_branch",
    "walk_in_place",
]

Rule = Callable[[Walk, Any, list[Any]], list[Any]]


def register(primitive: _jax.Primitive, descriptor: HigherOrder, rule: Rule | None = None) -> None:
    """Registers what harvest knows about ``primitive`` and how its walk handles it.

    One call, one object: the descriptor holds the bodies, the walk rule and the
    optional facts its fields list (``batched_branch``, for one).

    Args:
        primitive: The JAX primitive (a ``Primitive`` of JAX's extension API) whose
            equations hold a body.
        descriptor: Its ``HigherOrder``: ``bodies(eqn)`` returns one ``Body`` per jaxpr
            the equation runs (its label, how many times it runs per run of the
            equation), plus the optional facts its fields list.
        rule: ``rule(walk, eqn, invals) -> outputs`` (a list), run where the
            walk meets an equation of ``primitive`` whose body holds a sow it
            handles; build it from ``walk_in_place``, ``retrace`` and
            ``plants_inside``. None: the descriptor's own ``rule`` (and if it has
            none either, a sow there is an error naming the primitive).

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
        ...     extend.HigherOrder(
        ...         lambda eqn: [extend.Body("twice", eqn.params["body"].jaxpr, runs=2)],
        ...         rule=walk_twice,
        ...     ),
        ... )
        >>> f = lambda x: twice(lambda y: sow(y + 1.0, name="h", mode="append"), x)
        >>> reap(f)(1.0)["h"]
        Array([2., 3.], dtype=float32, weak_type=True)
        >>> [(s.name, s.fires, s.where) for s in sites(f)(1.0)]
        [('h', 2, 'twice')]
    """
    if not isinstance(descriptor, HigherOrder):
        raise TypeError(
            "harvest.extend.register: descriptor must be a harvest.extend.HigherOrder, got "
            f"{type(descriptor).__name__}."
        )
    if rule is not None:
        if not callable(rule):
            raise TypeError(f"harvest.extend.register: rule must be callable, got {rule!r}.")
        descriptor = dataclasses.replace(descriptor, rule=rule)
    _register(primitive, descriptor)


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
        A call-like primitive whose rule walks its body in place:

        >>> import jax, jax.numpy as jnp
        >>> from jax.extend.core import Primitive, jaxpr_as_fun
        >>> from harvest import extend, plant, reap, sow
        >>> call_p = Primitive("my_call")
        >>> call_p.multiple_results = True
        >>> _ = call_p.def_impl(lambda *xs, body: jaxpr_as_fun(body)(*xs))
        >>> _ = call_p.def_abstract_eval(lambda *xs, body: body.out_avals)
        >>> def my_call(f, x):
        ...     return call_p.bind(x, body=jax.make_jaxpr(f)(x))[0]
        >>> def in_place(walk, eqn, invals):
        ...     body = eqn.params["body"]
        ...     return extend.walk_in_place(walk, body.jaxpr, body.consts, invals)
        >>> body = lambda eqn: [extend.Body("my_call", eqn.params["body"].jaxpr)]
        >>> extend.register(call_p, extend.HigherOrder(body, rule=in_place, call=True))
        >>> f = lambda x: my_call(lambda y: sow(y * 2.0, name="h", mode="strict") + 1.0, x)
        >>> reap(f)(3.0)
        {'h': Array(6., dtype=float32, weak_type=True)}
        >>> plant(f)({"h": jnp.float32(10.0)}, 3.0)
        Array(11., dtype=float32)
    """
    return cast(list[Any], _interpret(walk, jaxpr, consts, list(args)))


def walk_in_branch(
    jaxpr: _jax.Jaxpr, consts: Sequence[Any], args: Sequence[Any], found: Any, stuck: Any
) -> list[Any]:
    """Evaluates a body inside a cond branch that vmap batches, its sows' values carried out.

    The building block of a descriptor's ``batched_branch``: each sow in ``jaxpr``
    takes its plant in place, and its value goes to ``found``, to leave the branch
    with its outputs (where the branch was not taken, the example's value is
    dropped); a sow this cannot carry out (inside a ``while_loop``, a custom
    derivative or a primitive without ``batched_branch``) goes to ``stuck``.

    Args:
        jaxpr: The body (an open jaxpr).
        consts: Values for its constvars.
        args: Values for its invars.
        found: The ``found`` that ``batched_branch`` was given.
        stuck: The ``stuck`` that ``batched_branch`` was given.

    Returns:
        The body's outputs, a list.

    Example:
        A primitive that runs its body twice in a row (not call-like), reaped
        inside a ``cond`` that ``vmap`` batches:

        >>> import jax, jax.numpy as jnp
        >>> from jax.extend.core import Primitive, jaxpr_as_fun
        >>> from jax.interpreters import batching
        >>> from harvest import extend, reap, sow
        >>> twice_p = Primitive("twice_in_branch")
        >>> twice_p.multiple_results = True
        >>> run = lambda x, body: jaxpr_as_fun(body)(*jaxpr_as_fun(body)(x))
        >>> _ = twice_p.def_impl(lambda x, *, body: run(x, body))
        >>> _ = twice_p.def_abstract_eval(lambda x, *, body: [x])
        >>> batching.primitive_batchers[twice_p] = lambda args, dims, *, body: (
        ...     jax.vmap(lambda x: run(x, body), in_axes=dims)(*args), [0])
        >>> def walk_twice(walk, eqn, invals):
        ...     body = eqn.params["body"]
        ...     once = extend.walk_in_place(walk, body.jaxpr, body.consts, invals)
        ...     return extend.walk_in_place(walk, body.jaxpr, body.consts, once)
        >>> def twice_in_branch(eqn, invals, found, stuck):
        ...     body = eqn.params["body"]
        ...     once = extend.walk_in_branch(body.jaxpr, body.consts, invals, found, stuck)
        ...     return extend.walk_in_branch(body.jaxpr, body.consts, once, found, stuck)
        >>> extend.register(twice_p, extend.HigherOrder(
        ...     lambda eqn: [extend.Body("twice", eqn.params["body"].jaxpr, runs=2)],
        ...     rule=walk_twice, batched_branch=twice_in_branch))
        >>> def f(x):
        ...     body = jax.make_jaxpr(lambda y: sow(y + 1.0, name="h", mode="append"))(x)
        ...     return jax.lax.cond(x > 0, lambda x: twice_p.bind(x, body=body)[0], jnp.negative, x)
        >>> reap(jax.vmap(f))(jnp.array([1.0, -1.0]))["h"]  # [occurrence, example]
        Array([[2., 0.],
               [3., 0.]], dtype=float32)
    """
    return _rewrite(jaxpr, consts, args, found, stuck)


def retrace(walk: Walk, jaxpr: _jax.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> Retraced:
    """Re-traces ``jaxpr`` through a child of ``walk`` into a new jaxpr that also returns its records.

    Only for a call-like primitive (see the module docstring). Bind the primitive
    again around ``result.jaxpr`` (it takes ``result.num_consts`` closed-over
    values, then the body's inputs, and returns the body's ``result.num_outs``
    outputs, then the records; a param that holds a ``ClosedJaxpr`` takes
    ``ClosedJaxpr(result.jaxpr, ())``), calling it on ``result.args``; then
    ``result.finish(walk, outputs)`` folds the records into ``walk`` and returns
    the body's own outputs.

    Args:
        walk: The walk the rule was given.
        jaxpr: The body (an open jaxpr).
        consts: Values for its constvars.
        args: Values for its invars (their shapes and dtypes are traced).

    Returns:
        A ``Retraced``: ``jaxpr``, ``args``, ``num_consts``, ``num_outs`` and ``finish``.

    Example:
        A call-like primitive bound again around its walked body, so it stays
        in the program (a jit's shardings, a custom rule, would be kept):

        >>> import jax, jax.numpy as jnp
        >>> from jax.extend.core import Primitive, jaxpr_as_fun
        >>> from harvest import call_and_reap, extend, reap, sow
        >>> call_p = Primitive("kept_call")
        >>> call_p.multiple_results = True
        >>> _ = call_p.def_impl(lambda *xs, body: jaxpr_as_fun(body)(*xs))
        >>> _ = call_p.def_abstract_eval(lambda *xs, body: body.out_avals)
        >>> def kept_call(f, x):
        ...     return call_p.bind(x, body=jax.make_jaxpr(f)(x))[0]
        >>> def rebound(walk, eqn, invals):
        ...     body = eqn.params["body"]
        ...     r = extend.retrace(walk, body.jaxpr, body.consts, invals)
        ...     return r.rebind(walk, eqn, "body")  # the body param, re-traced
        >>> body = lambda eqn: [extend.Body("kept_call", eqn.params["body"].jaxpr)]
        >>> extend.register(call_p, extend.HigherOrder(body, rule=rebound, call=True))
        >>> f = lambda x: kept_call(lambda y: jnp.sin(sow(y * 2.0, name="h", mode="strict")), x)
        >>> out, reaped = call_and_reap(f)(0.25)
        >>> bool(jnp.allclose(out, jnp.sin(0.5))), reaped
        (True, {'h': Array(0.5, dtype=float32, weak_type=True)})
        >>> "kept_call" in str(jax.make_jaxpr(reap(f))(0.25))
        True
    """
    return cast(Retraced, _retrace(walk, jaxpr, consts, list(args)))


def plants_inside(walk: Walk, jaxprs: Sequence[_jax.Jaxpr]) -> bool:
    """Whether ``walk`` plants a value at a sow inside ``jaxprs``.

    A rule that keeps its primitive's rule (a derivative, a batching rule) when reaping
    usually inlines the body where it plants: the planted body is not what that rule describes.

    Args:
        walk: The walk the rule was given.
        jaxprs: The bodies to look in (open jaxprs).

    Returns:
        True if a sow there is planted by this walk.

    Example:
        A rule that keeps its primitive when reaping and inlines the body where
        a value is planted inside:

        >>> import jax, jax.numpy as jnp
        >>> from jax.extend.core import Primitive, jaxpr_as_fun
        >>> from harvest import extend, plant, reap, sow
        >>> call_p = Primitive("either_call")
        >>> call_p.multiple_results = True
        >>> _ = call_p.def_impl(lambda *xs, body: jaxpr_as_fun(body)(*xs))
        >>> _ = call_p.def_abstract_eval(lambda *xs, body: body.out_avals)
        >>> def either_call(f, x):
        ...     return call_p.bind(x, body=jax.make_jaxpr(f)(x))[0]
        >>> def rule(walk, eqn, invals):
        ...     body = eqn.params["body"]
        ...     if extend.plants_inside(walk, [body.jaxpr]):
        ...         return extend.walk_in_place(walk, body.jaxpr, body.consts, invals)
        ...     return extend.retrace(walk, body.jaxpr, body.consts, invals).rebind(walk, eqn, "body")
        >>> body = lambda eqn: [extend.Body("either_call", eqn.params["body"].jaxpr)]
        >>> extend.register(call_p, extend.HigherOrder(body, rule=rule, call=True))
        >>> f = lambda x: either_call(lambda y: sow(y + 1.0, name="h", mode="strict") * 3.0, x)
        >>> "either_call" in str(jax.make_jaxpr(reap(f))(1.0))  # reaped: kept
        True
        >>> "either_call" in str(jax.make_jaxpr(plant(f))({"h": 0.5}, 1.0))  # planted: inlined
        False
        >>> reap(f)(1.0), plant(f)({"h": jnp.float32(0.5)}, 1.0)
        ({'h': Array(2., dtype=float32, weak_type=True)}, Array(1.5, dtype=float32))
    """
    return bool(walk.plants_inside(list(jaxprs)))
