"""`make_effect_handler`: custom interpreters that thread a state through chosen primitives.

The transformed function is traced to a jaxpr and evaluated equation by
equation. An equation whose primitive has a handler runs the handler
instead, `handler(state, *inputs, **params) -> (outputs, new state)`; every
other equation is bound as it was. Calls (`jit`, `closed_call`, `remat`,
`custom_jvp`/`custom_vjp` functions) whose bodies hold a handled primitive are
walked into, so handlers see through `jax.jit`; loops and branches holding
one are an error (the state cannot be threaded through them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Concatenate

import jax

from .. import _jax
from .._jax import sub_jaxprs
from .._typing import P, R
from ._inverse import CALLS, call_body, trace_program

# handler(state, *inputs, **params) -> (outputs, new state)
Handler = Callable[..., tuple[Any, Any]]


def _holds(jaxpr: _jax.Jaxpr, handlers: dict[Any, Handler]) -> bool:
    return any(
        e.primitive in handlers or any(_holds(j, handlers) for j in sub_jaxprs(e))
        for e in jaxpr.eqns
    )


def _eval(
    jaxpr: _jax.Jaxpr,
    consts: Sequence[Any],
    state: Any,
    args: Sequence[Any],
    handlers: dict[Any, Handler],
) -> tuple[list[Any], Any]:
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, _jax.Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive in handlers:
            outs, state = handlers[eqn.primitive](state, *invals, **eqn.params)
        elif eqn.primitive in CALLS and _holds(call_body(eqn)[0], handlers):
            body, body_consts = call_body(eqn)
            outs, state = _eval(body, body_consts, state, invals, handlers)
        elif any(_holds(j, handlers) for j in sub_jaxprs(eqn)):
            handled = sorted({str(p) for p in handlers})
            raise NotImplementedError(
                f"make_effect_handler: a handled primitive ({', '.join(handled)}) is bound inside "
                f"`{eqn.primitive}`, and the handlers' state cannot be threaded through it. Move "
                "the handled operations out of the loop or branch."
            )
        else:
            outs = _jax.bind_with(eqn.primitive, eqn.params, invals)
        outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars], state


def make_effect_handler(
    handlers: dict[Any, Handler],
) -> Callable[[Callable[P, R]], Callable[Concatenate[Any, P], tuple[R, Any]]]:
    """Returns a transformation `f -> g(state, *args) -> (f's output, final state)`.

    `handlers` maps JAX primitives to `handler(state, *inputs, **params)`
    returning `(outputs, new state)` (a list of outputs for primitives with
    several). Primitives without a handler run as usual. The state is any
    Python value or pytree; it stays a Python value unless a handler makes it
    an array.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import harvest.ppl as ppl
        >>> def count_exp(n, x, **params):  # params: the primitive's, e.g. exp's accuracy
        ...     return jnp.exp(x), n + 1
        >>> counting = ppl.make_effect_handler({jax.lax.exp_p: count_exp})
        >>> counting(lambda x: jnp.exp(jnp.exp(x)))(0, 0.0)
        (Array(2.7182817, dtype=float32, weak_type=True), 2)
    """
    if not isinstance(handlers, dict) or not all(callable(h) for h in handlers.values()):
        raise TypeError(
            "make_effect_handler takes a dict {primitive: handler(state, *inputs, **params) -> "
            f"(outputs, state)}}; got {handlers!r}."
        )

    def transform(f: Callable[P, R]) -> Callable[Concatenate[Any, P], tuple[R, Any]]:
        def handled(state: Any, /, *args: P.args, **kwargs: P.kwargs) -> tuple[R, Any]:
            closed, out_shape, arrays = trace_program(f, args, kwargs)
            outs, state = _eval(closed.jaxpr, closed.consts, state, arrays, handlers)
            return jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(out_shape), outs
            ), state

        return handled

    return transform
