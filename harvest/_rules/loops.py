"""Loops: scan (and fori_loop with static bounds) and while_loop.

In a scan, `collect` and `append` occurrences become extra per-iteration
outputs, stacked on a leading axis index-aligned with the forward iterations;
`clobber` and `sow_cond` values ride in the carry, so the last one to fire
wins. A while loop has no fixed length, so only the carried modes work there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import _errors, _jax
from .._interpreter import interpret, register
from .._occurrences import Record, stacked_record


def _no_strict(sites, where):
    for site in sites.values():
        if site.mode.single and not site.mode.stacks_in_loops:
            raise _errors.strict_in_loop(site, where)


@register(_jax.scan_p)
def _scan(walk, eqn, invals):
    p = _jax.Scan.of(eqn)
    body = p.body
    sites = walk.handled_sites([body.jaxpr])
    _no_strict(sites, "scan")
    nc, ncarry, length = p.num_consts, p.num_carry, p.length
    consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
    carried = walk.carried(sites, "scan")
    plants = walk.shifted_plants()
    holder = {}

    def step(carry, x):
        c, rec = carry
        idx, x = x
        body_plants = {
            path: pl.per_iteration(idx, body.jaxpr, sites[path])
            for path, pl in plants.items()
            if path in sites
        }
        child = walk.child({path: (carried[path][0], v) for path, v in rec.items()}, body_plants)
        outs = interpret(child, body.jaxpr, body.consts, [*consts, *c, *x])
        holder["child"] = child
        rec = {path: child.records[path].values[0] for path in carried}
        stacked = {
            path: r.chunk() for path, r in child.records.items() if r.site.mode.stacks_in_loops
        }
        return (outs[:ncarry], rec), (outs[ncarry:], stacked)

    rec0 = {path: value for path, (_, value) in carried.items()}
    (c, rec), (ys, stacked) = lax.scan(
        step,
        (init, rec0),
        (jnp.arange(length), xs),
        length=length,
        reverse=p.reverse,
        unroll=p.unroll,
    )
    child = holder["child"]
    records = {path: Record(carried[path][0], [v]) for path, v in rec.items()}
    for path, chunk in stacked.items():
        records[path] = stacked_record(sites[path], chunk)
    # Stacked entries (and oryx's once-per-loop stacks) keep their count; every
    # other mode's occurrences repeat once per iteration.
    seen = {
        path: n if sites[path].mode.entries or sites[path].mode.stacks_per_loop else length * n
        for path, n in child.seen.items()
    }
    walk.absorb(records, seen)
    return [*c, *ys]


@register(_jax.while_p)
def _while(walk, eqn, invals):
    p = _jax.While.of(eqn)
    cond, body = p.cond, p.body
    sites = walk.handled_sites([body.jaxpr])
    _no_strict(sites, "while_loop")
    for site in sites.values():
        if site.mode.stacks_in_loops:
            raise _errors.stacked_in_while(site)
    for site in walk.handled_sites([cond.jaxpr]).values():
        raise _errors.sow_in_while_cond(site)
    for path in sites:
        if path in walk.plants and walk.plants[path].takes_index():
            raise _errors.indexed_plant_in_while(sites[path])
    ncc, nbc = p.cond_nconsts, p.body_nconsts
    cconsts, bconsts, init = invals[:ncc], invals[ncc : ncc + nbc], invals[ncc + nbc :]
    # vmap of a loop whose predicate differs per example: JAX stages a while
    # whose cond gives one bool per example; it runs while any holds, and each
    # example keeps its carry (batch axes first) once its own fails. The
    # records ride in that carry, per example, and the loop is re-bound as
    # staged, so an outer harvest of what this walk re-emits sees the same.
    batch = cond.out_avals[0].shape
    carried = walk.carried(sites, "while_loop", batch)

    def cond_fn(carry):
        (out,) = interpret(walk.child(plants={}), cond.jaxpr, cond.consts, [*cconsts, *carry[0]])
        return out

    def body_fn(carry):
        c, rec = carry
        child = walk.child({path: (carried[path][0], v) for path, v in rec.items()})
        outs = interpret(child, body.jaxpr, body.consts, [*bconsts, *c])
        new = {path: child.records[path].values[0] for path in carried}
        if batch:  # per example, whether or not vmap batched the value
            new = {path: carried[path][0].fit(v, "while_loop", batch) for path, v in new.items()}
        return outs, new

    rec0 = {path: value for path, (_, value) in carried.items()}
    loop = _while_per_example if batch else lax.while_loop
    c, rec = loop(cond_fn, body_fn, (list(init), rec0))
    walk.absorb({path: Record(carried[path][0], [v]) for path, v in rec.items()}, {})
    return c


def _while_per_example(cond_fn, body_fn, init):
    """`lax.while_loop`, for a `cond_fn` that gives one bool per example."""
    leaves, tree = jax.tree_util.tree_flatten(init)
    # The carry's types must match exactly, so no weak types on either side.
    strong = lambda xs: [lax.convert_element_type(x, jnp.result_type(x)) for x in xs]
    leaves = strong(leaves)
    unflatten = functools.partial(jax.tree_util.tree_unflatten, tree)
    cond = jax.make_jaxpr(lambda *xs: cond_fn(unflatten(xs)))(*leaves)
    body = jax.make_jaxpr(lambda *xs: strong(jax.tree_util.tree_leaves(body_fn(unflatten(xs)))))(
        *leaves
    )
    return unflatten(_jax.bind_while(cond, body, leaves))
