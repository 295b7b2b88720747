"""`jax.custom_batching.custom_vmap`: a descriptor and a walk rule, then its sows under `vmap`.

Its first part is CONTRIBUTING.md's worked example of "Adding a rule", which
writes it against `harvest.extend`; here, below the public API, it calls the
walk's own names that `extend` wraps (`interpret` for `walk_in_place`).
Its second part reaches the sows under `vmap` (see below).

Outside `vmap`, a `custom_vmap` function runs its body; under `vmap`, JAX runs
the user's batching rule instead. Reaping inside keeps that rule for the
outputs, as `_rules/calls.py` keeps a custom derivative's: the walked body is
bound as a new `custom_vmap` whose rule batches the outputs with the user's
rule and the reaped values by ordinary `vmap` of the walked body, so each
example's values are reaped, batch axis first. Planting inside changes the
function the user's rule describes, so a planted body is walked in place and
batched as written.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from ... import _jax
from .._evaluator import evaluate
from .._higher_order import Body, HigherOrder, register
from .._interpreter import Walk, interpret, retrace
from .._primitive import tracing_a_harvest
from .._sow_index import sites_in
from .calls import missing_sows_step, original_of


def _function(eqn: Any) -> list[Body]:
    call = eqn.params["call"]
    return [Body("custom_vmap", call.jaxpr, call.consts)]


def _custom_vmap(walk: Walk, eqn: Any, invals: list[Any]) -> list[Any]:
    call = eqn.params["call"]
    if walk.plants_inside([call.jaxpr]):
        return interpret(walk, call.jaxpr, call.consts, list(invals))
    r = retrace(walk, call.jaxpr, call.consts, list(invals))
    walked = functools.partial(_jax.eval_jaxpr, r.jaxpr, ())  # closed-over values, then inputs
    k, n = r.num_consts, r.num_outs

    @custom_vmap
    def wrapped(*xs: Any) -> list[Any]:
        return list(walked(*xs))

    @wrapped.def_vmap
    def batched(axis_size: int, in_batched: list[bool], *xs: Any) -> tuple[list[Any], list[bool]]:
        axes = [0 if b else None for b in in_batched]
        # The user's rule, for the outputs: vmap of the original call runs it.
        outs = jax.vmap(original_of(eqn), in_axes=axes[k:], axis_size=axis_size)(*xs[k:])
        # The reaped values, per example: vmap of the walked body.
        recs = jax.vmap(lambda *ys: walked(*ys)[n:], in_axes=axes, axis_size=axis_size)(*xs)
        values = [*outs, *recs]
        return values, [True] * len(values)

    return r.finish(walk, list(wrapped(*r.args)))


register(
    _jax.custom_vmap_p,
    HigherOrder(_function, rule=_custom_vmap, call=True, custom_rule="vmap"),
)


# Under vmap, JAX runs the user's rule in place of the body: a harvest tracing
# the vmapped function would find no sow where the rule does not sow itself. So
# while a harvest traces, the body's sows the rule leaves out are shown to the
# walk as the body would have sown them under vmap (run batched for their
# values alone, role "unplantable": reaped, but a plant there is an error, as it
# could not change the rule's outputs).


def _batch(
    jax_rule: Any, axis_data: Any, args: list[Any], dims: list[Any], *, call: Any, **params: Any
) -> Any:
    if not tracing_a_harvest() or not sites_in(call.jaxpr) or all(d is None for d in dims):
        return jax_rule(axis_data, args, dims, call=call, **params)
    got: dict[str, Any] = {}

    def rule_ran(*xs: Any) -> Any:
        outs, got["dims"] = jax_rule(axis_data, list(xs), dims, call=call, **params)
        return outs

    ran = jax.make_jaxpr(rule_ran)(*args)  # the rule, as JAX runs it here
    outs = _jax.eval_jaxpr(ran.jaxpr, ran.consts, *args)
    step = missing_sows_step(call.jaxpr, ran.jaxpr, "unplantable")
    if step is not None:
        size = next(jnp.shape(a)[d] for a, d in zip(args, dims) if d is not None)
        jax.vmap(
            lambda *xs: evaluate(call.jaxpr, call.consts, xs, step),
            in_axes=list(dims),
            axis_size=size,
        )(*args)
    return outs, got["dims"]


_jax.wrap_batching(_jax.custom_vmap_p, _batch)
