"""custom_linear_solve holding sows (harvest/_walk/_rules/solves.py), checked against
hand-written solves."""

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from harvest import call_and_reap, harvest, plant, reap, sow

A = jnp.array([[4.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 2.0]])
B = jnp.array([1.0, -2.0, 0.5])


def close(a, b):
    conftest.close(a, b, rtol=1e-5, atol=1e-5)


def refined(b):
    """Solves A x = b by one refinement step from x0 = b: calls matvec once."""

    def matvec(v):
        return sow(A @ v, name="Av")

    def solve(mv, b):
        residual = b - mv(b)
        return b + sow(jnp.linalg.solve(A, residual), name="step")

    return lax.custom_linear_solve(matvec, b, solve, symmetric=True)


def by_hand(b, av=None):
    """`refined` written out, with the sown A @ b optionally replaced."""
    av = A @ b if av is None else av
    step = jnp.linalg.solve(A, b - av)
    return b + step, {"Av": (av,), "step": (step,)}


def test_outside_a_harvest_it_solves_and_differentiates():
    close(refined(B), jnp.linalg.solve(A, B))
    close(jax.grad(lambda b: refined(b).sum())(B), jnp.linalg.solve(A.T, jnp.ones(3)))


@pytest.mark.parametrize("wrap", ["eager", "jit", "vmap"])
def test_reaps_solve_and_the_matvec_it_calls(wrap):
    f = call_and_reap(refined)
    if wrap == "jit":
        f = jax.jit(f)
    if wrap == "vmap":
        bs = jnp.stack([B, 2.0 * B])
        want = jax.vmap(by_hand)(bs)
        close(jax.vmap(f)(bs), want)
    else:
        close(f(B), by_hand(B))


def test_the_solution_keeps_its_implicit_derivative():
    # The solution's derivative comes from custom_linear_solve (A^-T); the reaped
    # values are differentiated by autodiff of `solve`.
    close(
        jax.grad(lambda b: call_and_reap(refined)(b)[0].sum())(B),
        jnp.linalg.solve(A.T, jnp.ones(3)),
    )
    close(jax.grad(lambda b: reap(refined)(b)["Av"][0].sum())(B), A.sum(0))
    jac = jax.jacfwd(lambda b: reap(refined)(b)["step"][0])(B)
    close(jac, jax.jacfwd(lambda b: by_hand(b)[1]["step"][0])(B))


def test_plant_inlines_the_solve():
    new = jnp.array([0.5, 0.5, 0.5])
    close(plant(refined)({"Av": (new,)}, B), by_hand(B, new)[0])
    out, reaps = harvest(refined)({"Av": lambda av: 2.0 * av}, B)
    want_out, want = by_hand(B, 2.0 * (A @ B))
    close((out, reaps), (want_out, {"step": want["step"]}))
    # Differentiating the planted function differentiates the solve as written.
    close(
        jax.grad(lambda b: plant(refined)({"Av": (new,)}, b).sum())(B),
        jax.grad(lambda b: by_hand(b, new)[0].sum())(B),
    )


def test_iterative_solver_in_a_while_loop():
    # jax.scipy's CG calls matvec inside a while_loop, so only carried modes reap:
    # `clobber` keeps the last matvec CG ran. The reference records every matvec
    # on the host instead.
    def cg(matvec):
        return lambda b: jax.scipy.sparse.linalg.cg(matvec, b, tol=1e-7)[0]

    seen = []

    def recorded(v):
        jax.debug.callback(lambda av: seen.append(np.asarray(av)), A @ v, ordered=True)
        return A @ v

    cg(recorded)(B)
    jax.effects_barrier()
    out, reaps = call_and_reap(cg(lambda v: sow(A @ v, name="Av", mode="clobber")))(B)
    close(out, jnp.linalg.solve(A, B))
    assert len(seen) > 2
    close(reaps, {"Av": jnp.asarray(seen[-1])})
    with pytest.raises(ValueError, match="while_loop"):
        reap(cg(lambda v: sow(A @ v, name="Av")))(B)


def test_a_sow_solve_never_runs_is_a_clear_error():
    def direct(b):
        matvec = lambda v: sow(A @ v, name="Av")  # noqa: E731
        return lax.custom_linear_solve(
            matvec, b, lambda mv, b: jnp.linalg.solve(A, b), symmetric=True
        )

    close(direct(B), jnp.linalg.solve(A, B))  # outside a harvest, fine
    with pytest.raises(ValueError, match=r"name='Av'.*`matvec`, which `solve` never calls"):
        reap(direct)(B)
    # another tag's walk passes these sows through
    close(plant(direct, tag="other")({}, B), jnp.linalg.solve(A, B))
