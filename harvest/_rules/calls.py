"""Call-like primitives: jit, closed_call, remat, and custom derivatives.

Each re-traces its body through the walk and re-binds the same primitive, so
a `jit` keeps its shardings and name, a `remat` its policy, and a custom
derivative its rule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from .. import _jax
from .._interpreter import interpret, register, retrace


@register(_jax.jit_p, _jax.closed_call_p, _jax.remat_p)
def _call(walk, eqn, invals):
    body = _jax.call_body(eqn)
    r = retrace(walk, body.jaxpr, body.consts, invals)
    outs = _jax.rebind_call(eqn, r.jaxpr, r.args, r.num_consts, len(r.jaxpr.outvars) - r.num_outs)
    return r.finish(walk, outs)


# Custom derivatives. Reaping inside keeps the user's rule for the outputs and
# differentiates the reaped values by ordinary autodiff of the body. Planting
# inside changes the function the rule describes, so the planted body is
# inlined and differentiated by ordinary autodiff instead.


def _original(eqn):
    return lambda *xs: _jax.rebind(eqn, xs)


def _add_cotangents(a, b):
    if a.dtype == jax.dtypes.float0:
        return a
    return a + b


def _instantiate(ct):
    if not isinstance(ct, SymbolicZero):
        return ct
    zeros = np.zeros if ct.dtype == jax.dtypes.float0 else jnp.zeros
    return zeros(ct.shape, ct.dtype)


def _all_zero(cts):
    return all(isinstance(ct, SymbolicZero) for ct in cts)


def _keeping_the_rule(wrap):
    """A rule that re-traces the primal body and wraps it with `wrap`, which
    attaches a derivative built from the user's rule and the walked body."""

    def rule(walk, eqn, invals):
        call = _jax.call_body(eqn)
        if walk.plants_inside([call.jaxpr]):
            return interpret(walk, call.jaxpr, call.consts, invals)
        r = retrace(walk, call.jaxpr, call.consts, invals)
        body = functools.partial(_jax.eval_jaxpr, r.jaxpr, ())
        wrapped = wrap(body, _original(eqn), r.num_consts, r.num_outs, _jax.custom_num_consts(eqn))
        return r.finish(walk, wrapped(*r.args))

    return rule


def _with_jvp(body, original, k, n, nconsts):
    """`body` (k closed-over inputs first, n outputs then records) under a custom_jvp
    (whose own JVP handles its `nconsts` closure-converted constants)."""

    @jax.custom_jvp
    def wrapped(*xs):
        return body(*xs)

    @wrapped.defjvp
    def wrapped_jvp(primals, tangents):
        outs, out_dots = jax.jvp(original, primals[k:], tangents[k:])
        recs, rec_dots = jax.jvp(lambda *xs: body(*xs)[n:], primals, tangents)
        return [*outs, *recs], [*out_dots, *rec_dots]

    return wrapped


def _with_vjp(body, original, k, n, nconsts):
    """`body` (k closed-over inputs first, n outputs then records) under a custom_vjp."""

    @jax.custom_vjp
    def wrapped(*xs):
        return body(*xs)

    def fwd(*xs):
        xs = [x.value for x in xs]
        return body(*xs), xs

    def bwd(xs, cts):
        # The user's backward rule for the outputs (its forward re-run here),
        # plain autodiff of the body for the reaped values. Either part whose
        # cotangents are all zero is skipped: grad of the outputs alone must not
        # differentiate the body, which may loop (while_loop has no VJP) or be
        # one the user's rule exists to avoid.
        total = [None] * len(xs)
        if not _all_zero(cts[:n]):
            # Its closure-converted constants are not differentiated, as in JAX.
            consts, args = xs[k : k + nconsts], xs[k + nconsts :]
            _, original_vjp = jax.vjp(lambda *ys: original(*consts, *ys), *args)
            total[k + nconsts :] = original_vjp([_instantiate(ct) for ct in cts[:n]])
        if not _all_zero(cts[n:]):
            _, records_vjp = jax.vjp(lambda *ys: body(*ys)[n:], *xs)
            from_recs = records_vjp([_instantiate(ct) for ct in cts[n:]])
            total = [b if a is None else _add_cotangents(a, b) for a, b in zip(total, from_recs)]
        return tuple(total)

    wrapped.defvjp(fwd, bwd, symbolic_zeros=True)
    return wrapped


register(_jax.custom_jvp_call_p)(_keeping_the_rule(_with_jvp))
register(_jax.custom_vjp_call_p)(_keeping_the_rule(_with_vjp))
