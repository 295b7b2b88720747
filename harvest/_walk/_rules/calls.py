"""Call-like primitives: jit, closed_call, remat, and custom derivatives.

Each re-traces its body through the walk and re-binds the same primitive, so
a `jit` keeps its shardings and name, a `remat` its policy, and a custom
derivative its rule.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from ... import _jax
from .._evaluator import evaluate
from .._higher_order import HigherOrder, call_body, describe, forwards_through_call, register
from .._interpreter import Policy, Walk, inside_rule, interpret, jvp_rule, retrace, rule_sites
from .._leaves import is_array
from .._paths import path_str
from .._primitive import sow_p, sows_bound_by, tracing_a_harvest
from .._site import Site
from .._sow_index import sites_in, sow_index


def _call_like(label: str, **extra: Any) -> HigherOrder:
    return HigherOrder(call_body(label), call=True, forwards=forwards_through_call, **extra)


def _restage_remat(eqn: Any, invals: list[Any], staged: Any, extra: Any) -> list[Any]:
    remat = _jax.Remat.of(eqn)
    (body,) = call_body("checkpoint")(eqn)
    fn = jax.checkpoint(staged(body), prevent_cse=remat.prevent_cse, policy=remat.policy)
    return list(fn(*invals, *extra))


def _call(walk, eqn, invals):
    body = _jax.call_body(eqn)
    r = retrace(walk, body.jaxpr, body.consts, invals)
    outs = _jax.rebind_call(eqn, r.jaxpr, r.args, r.num_consts, len(r.jaxpr.outvars) - r.num_outs)
    return r.finish(walk, outs)


# Custom derivatives. Reaping inside keeps the user's rule for the outputs and
# differentiates the reaped values by ordinary autodiff of the body. Planting
# inside changes the function the rule describes, so the planted body is
# inlined and differentiated by autodiff -- except in a custom_vjp whose body
# holds a while_loop (an ODE solver), which autodiff cannot reverse: there the
# user's backward rule is re-run with the plants in place (`_PlantsInRule`),
# right for a rule that re-runs the body's function (odeint's adjoint), an
# error otherwise.


def original_of(eqn):
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
        planted = walk.plants_inside([call.jaxpr])
        if planted and not (wrap is with_vjp and _holds_while(call.jaxpr)):
            return interpret(walk, call.jaxpr, call.consts, invals)
        r = retrace(walk, call.jaxpr, call.consts, invals)
        body = functools.partial(_jax.eval_jaxpr, r.jaxpr, ())
        extra = () if not planted else (_PlantsInRule.of(walk, eqn, call.jaxpr, r),)
        wrapped = wrap(
            body, original_of(eqn), r.num_consts, r.num_outs, _jax.custom_num_consts(eqn), *extra
        )
        return r.finish(walk, wrapped(*r.args))

    return rule


@dataclasses.dataclass(frozen=True)
class _PlantsInRule:
    """The plants inside a custom_vjp's body, for its backward rule to re-run.

    A rule that re-runs the body's function (odeint's adjoint) meets its sows
    again: each planted one binds as the plant applied, so the rule describes
    the planted function. The plants' arrays are among the re-traced body's
    closed-over values (`at`: their positions), so the rule gets them as
    residuals, not values of a trace that has ended. Refused (`refusal`): a
    plant per occurrence or by index (the rule's occurrences are not the
    body's), a differentiated planted value (the rule gives it no cotangent),
    and a rule that does not re-run every planted sow.
    """

    policy: Policy
    plants: dict[tuple, Any]
    at: dict[tuple, list[int | None]]
    site: Site
    name: str
    refusal: str | None  # why no plant can be re-run here; None: they can

    @classmethod
    def of(cls, walk: Walk, eqn: Any, jaxpr: Any, r: Any) -> _PlantsInRule:
        sites = walk.handled_sites([jaxpr])
        plants = {p: pl for p, pl in walk.plants.items() if p in sites}
        consts = r.args[: r.num_consts]
        at: dict[tuple, list[int | None]] = {}
        refusal = None
        for path, plant in plants.items():
            if plant.per_occurrence() or plant.takes_index():
                refusal = "occurrence"
                continue
            at[path] = [
                next((i for i, c in enumerate(consts) if c is leaf), -1) if is_array(leaf) else None
                for leaf in jax.tree_util.tree_leaves(plant.value)
            ]
            if -1 in at[path]:  # not passed to the body: the rule could not be given it
                refusal = refusal or "value"
        site = next(sites[p] for p in plants)
        return cls(walk.policy, plants, at, site, _jax.body_function_name(eqn), refusal)

    def error(self, reason: str) -> ValueError:
        where = f"the custom_vjp function {self.name!r}" if self.name else "a custom_vjp function"
        what, why, fix = {
            "occurrence": (
                "a plant per occurrence (rows, entries, or a callable taking the index)",
                "its backward rule re-runs the body as often as it needs (not the body's occurrences)",
                "Plant one value, or a callable old -> new, used at every occurrence",
            ),
            "value": (
                "a planted value that is itself differentiated",
                "its backward rule, re-run with the plant in place, gives no derivative for it",
                "Plant a value that does not depend on what you differentiate (jax.lax.stop_gradient)",
            ),
            "rule": (
                "a value planted",
                "its backward rule does not re-run the planted sow (it was written for the "
                "unplanted function)",
                "Write the planted computation into the function the rule differentiates",
            ),
        }[reason]
        return ValueError(
            f"Cannot differentiate through {where} with {what} at {self.site} inside it: its body holds "
            f"a while_loop, which autodiff cannot reverse, and {why}, so the gradient would be "
            f"silently wrong. {fix}, or plant outside the custom_vjp function."
        )

    def check_differentiated(self, perturbed: list[bool]) -> None:
        """Raises where an input the rule cannot differentiate planted is."""
        if self.refusal is not None and any(perturbed):
            raise self.error(self.refusal)
        if any(perturbed[i] for at in self.at.values() for i in at if i is not None):
            raise self.error("value")

    def rerun(self, linearize: Any, consts: list[Any], cts: list[Any]) -> Any:
        """``linearize() -> (out, vjp)`` and ``vjp(cts)`` run with the plants in
        place, their arrays from ``consts``: the user's rule, planted."""
        plants = {}
        for path, plant in self.plants.items():
            leaves, tree = jax.tree_util.tree_flatten(plant.value)
            leaves = [l if i is None else consts[i] for l, i in zip(leaves, self.at[path])]
            plants[path] = dataclasses.replace(
                plant, value=jax.tree_util.tree_unflatten(tree, leaves)
            )
        handler = _Replant(self.policy, plants)
        with sows_bound_by(handler):
            _, vjp = linearize()
            handler.fired.clear()  # the forward re-ran the planted body; does the backward?
            out = vjp(cts)
        if not handler.fired >= set(plants):
            raise self.error("rule")
        return out


class _Replant:
    """Binds each sow a plant targets as the plant applied (every firing alike),
    and notes which were."""

    def __init__(self, policy: Policy, plants: dict[tuple, Any]) -> None:
        self.policy, self.plants = policy, plants
        self.fired: set[tuple] = set()

    def __call__(self, args: tuple, params: dict) -> Any:
        site = Site.bound(args, params)
        path = self.policy.key(site)
        if not self.policy.handles(site) or path not in self.plants:
            return None
        self.fired.add(path)
        n = site.tree.num_leaves
        value = jax.tree_util.tree_unflatten(site.tree, args[:n])
        pred = args[n] if len(args) > n else None
        one = Walk(self.policy, self.plants, reap=False)
        return jax.tree_util.tree_leaves(one.sow(site, value, pred, params.get("role")))


def _holds_while(jaxpr: Any) -> bool:
    """Whether a while_loop runs somewhere in `jaxpr` (reverse-mode autodiff stops there)."""
    return any(
        eqn.primitive is _jax.while_p or any(_holds_while(sub) for sub in _jax.sub_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def with_jvp(body, original, k, n, nconsts):
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


def with_vjp(body, original, k, n, nconsts, planted=None):
    """`body` (k closed-over inputs first, n outputs then records) under a custom_vjp.

    `planted` (a `_PlantsInRule`): the plants inside the body, which the
    user's rule re-runs planted, or whose error it raises where an input is
    differentiated."""

    @jax.custom_vjp
    def wrapped(*xs):
        return body(*xs)

    def fwd(*xs):
        if planted is not None:
            planted.check_differentiated([x.perturbed for x in xs])
        xs = [x.value for x in xs]
        return body(*xs), xs

    def bwd(xs, cts):
        # The user's backward rule for the outputs (its forward re-run here),
        # autodiff of the body for the reaped values. A part whose cotangents are
        # all zero is skipped: grad of the outputs alone must not differentiate
        # the body (a while_loop has no VJP; the user's rule may exist to avoid it).
        total = [None] * len(xs)
        if not _all_zero(cts[:n]):
            # Its closure-converted constants are not differentiated, as in JAX.
            consts, args = xs[k : k + nconsts], xs[k + nconsts :]
            linearize = lambda: jax.vjp(lambda *ys: original(*consts, *ys), *args)  # noqa: E731
            out_cts = [_instantiate(ct) for ct in cts[:n]]
            if planted is None:
                total[k + nconsts :] = linearize()[1](out_cts)
            else:
                total[k + nconsts :] = planted.rerun(linearize, xs[:k], out_cts)
        if not _all_zero(cts[n:]):
            _, records_vjp = jax.vjp(lambda *ys: body(*ys)[n:], *xs)
            from_recs = records_vjp([_instantiate(ct) for ct in cts[n:]])
            total = [b if a is None else _add_cotangents(a, b) for a, b in zip(total, from_recs)]
        return tuple(total)

    wrapped.defvjp(fwd, bwd, symbolic_zeros=True)
    return wrapped


_keeping_the_jvp_rule = _keeping_the_rule(with_jvp)


# Sows in a custom_jvp's JVP rule run where JAX differentiates the call (as
# oryx reaps them, under `jax.jvp(reap(f))`). A walk under a differentiation
# trace binds a custom_jvp whose rule is the user's rule, walked: JAX calls it
# at bind time, one level down, so what it reaps has no tangent.


def rule_only_sites(policy: Policy, eqn: Any) -> dict[tuple[str, ...], Any]:
    """The sites `policy` handles in the JVP rule of `eqn` that its body does not
    sow (a rule that calls its own function sows the body's names again)."""
    found = rule_sites(eqn)
    if not found:
        return {}
    in_body = sow_index(_jax.call_body(eqn).jaxpr).names
    return {policy.key(s): s for s in found if policy.handles(s) and (s.tag, s.path) not in in_body}


def holds_rule_sows(jaxpr: Any, policy: Policy) -> bool:
    """Whether a custom_jvp among `jaxpr`'s own equations has a JVP rule sowing
    for `policy` (ones inside a jit, scan or cond body are staged again, where
    no rule runs, so walking in place would not reach them either)."""
    return any(rule_only_sites(policy, eqn) for eqn in jaxpr.eqns)


def _custom_jvp(walk: Walk, eqn: Any, invals: list[Any]) -> list[Any]:
    # The rule is traced only where JAX differentiates: elsewhere it never runs.
    rule_only = rule_only_sites(walk.policy, eqn) if _jax.differentiating() else {}
    if not rule_only:
        return _keeping_the_jvp_rule(walk, eqn, invals)
    call = _jax.call_body(eqn)
    in_body = walk.handled_sites([call.jaxpr])
    if in_body:
        raise ValueError(
            f"The sow site {next(iter(rule_only.values()))} sits in the JVP rule of a custom_jvp "
            "function that also sows "
            f"{', '.join(map(repr, map(path_str, in_body)))} in its body. Differentiated, JAX runs the rule and not "
            "the body, so these cannot both be reaped or planted. Sow in one of the two (a rule may "
            "call the function itself)."
        )
    found = jvp_rule(eqn)
    assert found is not None  # it has sites
    rule, out_zeros = found
    nconsts = _jax.custom_num_consts(eqn)
    # Planted values enter as arguments, so the rule (run one level down) sees
    # their primals; a planted tangent is ignored, as in oryx.
    planted = {
        p: walk.plants[p].value
        for p in rule_only
        if p in walk.plants and not callable(walk.plants[p].value)
    }
    leaves, tree = jax.tree_util.tree_flatten(planted)
    k = len(leaves)

    @jax.custom_jvp
    def walked(*xs: Any) -> list[Any]:
        return _jax.rebind(eqn, xs[k:])

    @walked.defjvp
    def walked_jvp(primals: Any, tangents: Any) -> tuple[list[Any], list[Any]]:
        values = jax.tree_util.tree_unflatten(tree, primals[:k])
        primals, tangents = primals[k + nconsts :], tangents[k + nconsts :]
        plants = {
            p: (dataclasses.replace(pl, value=values[p]) if p in values else pl).shift(
                walk.seen.get(p, 0)
            )
            for p, pl in walk.plants.items()
        }
        reaping, running = walk.child(plants=plants), walk.child(plants=plants)
        with inside_rule():
            # Reaped at zero tangents: a sown tangent would not be known under
            # reverse mode, so reaps are values at the primals, alike in both modes.
            interpret(reaping, rule.jaxpr, rule.consts, [*primals, *map(_zero_tangent, tangents)])
            ran = interpret(running, rule.jaxpr, rule.consts, [*primals, *tangents])
        walk.absorb(reaping.records, reaping.seen)
        outs, dots = ran[: len(out_zeros)], iter(ran[len(out_zeros) :])
        return outs, [_zero_tangent(o) if zero else next(dots) for o, zero in zip(outs, out_zeros)]

    return walked(*leaves, *invals)


def _zero_tangent(x: Any) -> Any:
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


# ---------------------------------------------------------------------------
# A custom derivative differentiated inside the harvested function
# (`reap(jax.grad(f))`): JAX runs the rule in place of the body, whose sows
# would vanish. While a harvest traces, the body's sows the rule does not sow
# are shown to the walk as the body sows them on the primals (role
# "rule_replaced": reaped; a plant there is an error, as it changes nothing).


def _show_replaced_sows(primals: list[Any], body: Any, rule: Any) -> None:
    if not tracing_a_harvest():
        return
    walked = body()
    if walked is None or not sites_in(walked.jaxpr):
        return
    ran = rule()
    if ran is None:  # the rule cannot be traced apart: what it sows is not known
        return
    step = missing_sows_step(walked.jaxpr, ran.jaxpr, "rule_replaced")
    if step is not None:
        evaluate(walked.jaxpr, walked.consts, primals, step)


def missing_sows_step(body: Any, ran: Any, role: str) -> Any:
    """The evaluator step for `body` that binds only the sows of names `ran` (the
    rule JAX runs in its place) does not sow, with `role`; None if there are none."""
    missing = sow_index(body).names - sow_index(ran).names
    return functools.partial(_missing_sows, missing, role) if missing else None


def _missing_sows(missing: frozenset[Any], role: str, eqn: Any, invals: list[Any]) -> Any:
    if eqn.primitive is sow_p:
        site = Site.of(eqn)
        if (site.tag, site.path) not in missing:
            return invals[: len(eqn.outvars)]
        return sow_p.bind(*invals, **dict(eqn.params, role=role))
    if not any(sites_in(j) for j in _jax.sub_jaxprs(eqn)):
        return _jax.rebind(eqn, invals)
    how = describe(eqn)
    step = functools.partial(_missing_sows, missing, role)
    if how.inlinable:
        (body,) = how.bodies(eqn)
        return evaluate(body.jaxpr, body.consts, invals, step)
    if how.restage is not None:
        staged = lambda body: lambda *xs: evaluate(body.jaxpr, body.consts, xs, step)  # noqa: E731
        return how.restage(eqn, invals, staged, ())
    return _jax.rebind(eqn, invals)


_jax.on_custom_rule_run(_show_replaced_sows)


# ---------------------------------------------------------------------------
# Registration: one per primitive.

register(_jax.jit_p, _call_like("jit", rule=_call))
register(_jax.closed_call_p, _call_like(_jax.closed_call_p.name, rule=_call))
# A plain call: the default rule of a call-like primitive walks its body in place.
register(_jax.core_call_p, _call_like(_jax.core_call_p.name))
register(_jax.remat_p, _call_like("checkpoint", restage=_restage_remat, rule=_call))
register(
    _jax.custom_jvp_call_p,
    _call_like("custom_jvp", custom_rule="jvp", jvp_rule=_jax.custom_jvp_rule, rule=_custom_jvp),
)
register(
    _jax.custom_vjp_call_p,
    _call_like("custom_vjp", custom_rule="vjp", rule=_keeping_the_rule(with_vjp)),
)
