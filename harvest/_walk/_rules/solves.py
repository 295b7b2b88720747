"""custom_linear_solve: the sows that run are those of `solve`.

At run time `lax.custom_linear_solve` runs only its `solve` function; `matvec`
runs inside it only if `solve` calls it (an iterative solver does), and the
other functions only in derivatives. So the walk re-traces `solve`, reaping
what it sows (including `matvec`'s sows, once per call), and keeps the
solution's implicit derivative: the solution is differentiated by the
original primitive, the reaped values by ordinary autodiff of `solve`.
Planting inside changes the system being solved, so a planted `solve` is
inlined and differentiated as written.
"""

from __future__ import annotations

from ... import _jax
from .._higher_order import Body, HigherOrder, register
from .._interpreter import interpret, retrace
from .calls import original_of, with_jvp


def _functions(eqn):
    """`solve` runs once per call; the others only where JAX differentiates, or
    inside `solve` (whose jaxpr then holds their sows again)."""
    jaxprs = _jax.LinearSolve.of(eqn).jaxprs
    return [
        Body(f"custom_linear_solve.{role}", closed.jaxpr, closed.consts, runs=int(role == "solve"))
        for role, closed in zip(jaxprs._fields, jaxprs)
        if closed is not None
    ]


def _linear_solve(walk, eqn, invals):
    jaxprs, lengths = _jax.LinearSolve.of(eqn)
    solve = jaxprs.solve
    runs = walk.handled_sites([solve.jaxpr])
    for role, closed in zip(jaxprs._fields, jaxprs):
        if closed is None or closed is solve:
            continue
        for path, site in walk.handled_sites([closed.jaxpr]).items():
            if path not in runs:
                raise ValueError(
                    f"The sow site {site} sits in custom_linear_solve's `{role}`, which `solve` "
                    "never calls: it runs only inside derivatives, where nothing can be reaped "
                    "or planted. Sow in `solve`, or call `matvec` from `solve`."
                )
    # invals: the consts of matvec, vecmat, solve, transpose_solve, then b.
    first = lengths.matvec + lengths.vecmat
    pick = lambda ins: [*ins[first : first + lengths.solve], *ins[sum(lengths) :]]  # noqa: E731
    if walk.plants_inside([solve.jaxpr]):
        return interpret(walk, solve.jaxpr, solve.consts, pick(invals))
    r = retrace(walk, solve.jaxpr, solve.consts, pick(invals))
    body = _jax.jaxpr_as_fun(_jax.ClosedJaxpr(r.jaxpr, ()))
    k = r.num_consts

    def solved(*xs):  # k closed-over values, then the primitive's own inputs
        return body(*xs[:k], *pick(xs[k:]))

    wrapped = with_jvp(solved, original_of(eqn), k, r.num_outs, 0)
    return r.finish(walk, wrapped(*r.args[:k], *invals))


register(_jax.linear_solve_p, HigherOrder(_functions, rule=_linear_solve))
