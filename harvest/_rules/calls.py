"""Call-like primitives: jit, closed_call, remat, and custom derivatives.

Each re-traces its body through the walk and re-binds the same primitive, so
a `jit` keeps its shardings and name, a `remat` its policy, and a custom
derivative its rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax._src.ad_checkpoint import remat_p
from jax._src.custom_derivatives import custom_jvp_call_p, custom_vjp_call_p
from jax.custom_derivatives import SymbolicZero
from jax._src.pjit import jit_p
from jax._src.sharding_impls import UNSPECIFIED

from .._interpreter import interpret, register, retrace


@register(jit_p)
def _jit(scope, eqn, invals):
    p = eqn.params
    r = retrace(scope, p["jaxpr"].jaxpr, p["jaxpr"].consts, invals)
    k, m = r.num_consts, len(r.jaxpr.outvars) - r.num_outs
    params = dict(
        p,
        jaxpr=core.ClosedJaxpr(r.jaxpr, ()),
        in_shardings=(UNSPECIFIED,) * k + tuple(p["in_shardings"]),
        in_layouts=(None,) * k + tuple(p["in_layouts"]),
        donated_invars=(False,) * k + tuple(p["donated_invars"]),
        out_shardings=tuple(p["out_shardings"]) + (UNSPECIFIED,) * m,
        out_layouts=tuple(p["out_layouts"]) + (None,) * m,
    )
    return r.finish(scope, jit_p.bind(*r.args, **params))


@register(core.closed_call_p)
def _closed_call(scope, eqn, invals):
    call = eqn.params["call_jaxpr"]
    r = retrace(scope, call.jaxpr, call.consts, invals)
    params = core.closed_call_p.get_bind_params(dict(eqn.params, call_jaxpr=core.ClosedJaxpr(r.jaxpr, ())))
    return r.finish(scope, core.closed_call_p.bind(*r.args, **params))


@register(remat_p)
def _remat(scope, eqn, invals):
    r = retrace(scope, eqn.params["jaxpr"], (), invals)
    params = dict(eqn.params, jaxpr=r.jaxpr)
    return r.finish(scope, remat_p.bind(*r.args, **params))


# Custom derivatives. Reaping inside keeps the user's rule for the outputs and
# differentiates the reaped values by ordinary autodiff of the body. Planting
# inside changes the function the rule describes, so the planted body is
# inlined and differentiated by ordinary autodiff instead.


def _original(eqn):
    params = eqn.primitive.get_bind_params(eqn.params)
    return lambda *xs: eqn.primitive.bind(*xs, **params)


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

    def rule(scope, eqn, invals):
        call = eqn.params["call_jaxpr"]
        if scope.plants_inside([call.jaxpr]):
            return interpret(scope, call.jaxpr, call.consts, invals)
        r = retrace(scope, call.jaxpr, call.consts, invals)
        body = core.jaxpr_as_fun(core.ClosedJaxpr(r.jaxpr, ()))
        wrapped = wrap(body, _original(eqn), r.num_consts, r.num_outs, eqn.params.get("num_consts", 0))
        return r.finish(scope, wrapped(*r.args))

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


register(custom_jvp_call_p)(_keeping_the_rule(_with_jvp))
register(custom_vjp_call_p)(_keeping_the_rule(_with_vjp))
