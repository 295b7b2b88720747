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

from .. import _jax
from .._interpreter import Plant, interpret, register
from .._primitive import sow_p
from .batched_cond import branch_p, recount
from .._site import LOOP_MODES, ROW_MODES, Record, mode_label


def _no_strict(sites, where):
    for site in sites.values():
        if site.mode == "strict":
            raise ValueError(
                f"The sow site {site} has mode 'strict' but sits inside a {where}, which "
                "sows it once per iteration. Use mode 'collect' or 'append' to keep every "
                "iteration, 'clobber' for the last one, or sow_cond for a chosen one."
            )


# primitive -> (equation -> how many times one run of it runs its body): append
# rows repeat that often, while a collect entry is stacked into one.
REPEATS = {_jax.scan_p: lambda eqn: _jax.Scan.of(eqn).length}

# primitive -> (equation -> the jaxprs one run of it runs), for primitives that
# hold jaxprs they run only when differentiated (custom_linear_solve).
RUNS: dict = {}


def occurrences(jaxpr, site):
    """How many entries (collect) or rows (append) of `site` one run of `jaxpr`
    gives, as reap returns them; a cond gives its longest branch's."""
    n = 0
    groups: dict = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            p = eqn.params
            n += (
                p["tag"] == site.tag
                and p["scope"] + (p["name"],) == site.name
                and p["mode"] == site.mode
                and p.get("role") != "record_only"
            )
        elif eqn.primitive is branch_p:
            n = recount(eqn, n, groups)
        elif eqn.primitive is _jax.cond_p:
            n += max(occurrences(b.jaxpr, site) for b in _jax.cond_branches(eqn))
        else:
            runs = RUNS.get(eqn.primitive, _jax.sub_jaxprs)(eqn)
            inner = sum(occurrences(j, site) for j in runs)
            repeat = REPEATS.get(eqn.primitive)
            n += inner * repeat(eqn) if repeat and site.mode in ROW_MODES else inner
    return n


def merge_rows(leaf):
    """[n, k, *s] -> [n * k, *s]; spelled out, as -1 cannot be inferred for zero-size rows."""
    return leaf.reshape((leaf.shape[0] * leaf.shape[1],) + leaf.shape[2:])


def peel(plant: Plant, idx):
    """Row `idx` of a plant stacked along a leading axis; other plants as they
    are, but a callable taking the occurrence index counts from row `idx`."""
    if callable(plant.value):
        return plant.starting_at(plant.start + idx)
    ndim = [len(a.shape) for a in plant.site.avals]
    if all(jnp.ndim(l) > d for l, d in zip(jax.tree_util.tree_leaves(plant.value), ndim)):
        return Plant(plant.site, jax.tree_util.tree_map(lambda l: l[idx], plant.value))
    return plant


def _per_iteration(plant: Plant, idx, body_jaxpr, body_site):
    """The part of a plant that one iteration (number `idx`) sees; `body_site`
    is the name's site in the body (its shape may differ from other sites')."""
    site = plant.site
    if site.mode == "stack":  # stacked once per enclosing loop
        return peel(plant, idx)
    if plant.takes_index():
        if site.mode == "collect":
            raise ValueError(
                f"The planted callable for the sow site {site} takes an occurrence index, but "
                "the site has mode 'collect' inside a loop, where reap stacks each sow's "
                "iterations into one entry, so occurrences have no single index. Use mode "
                "'append' (one row per iteration), or a callable of the old value alone."
            )
        # Iteration `idx` starts `idx` bodies' worth of rows later.
        return plant.starting_at(plant.start + idx * occurrences(body_jaxpr, site))
    if not plant.per_occurrence():
        return plant
    if site.mode == "collect":
        # The body's entries come first, each stacked over iterations (or one
        # value for all); entries for later sows are not the body's to slice.
        ndim = [len(a.shape) for a in body_site.avals]
        n = occurrences(body_jaxpr, site)

        def entry(e):
            leaves = jax.tree_util.tree_leaves(e)
            stacked = [jnp.ndim(l) > d for l, d in zip(leaves, ndim)]
            return jax.tree_util.tree_map(lambda l: l[idx], e) if all(stacked) else e

        return Plant(site, tuple(entry(e) for e in plant.value[:n]) + plant.value[n:])
    k = occurrences(body_jaxpr, site)
    return Plant(site, jax.tree_util.tree_map(lambda l: lax.dynamic_slice_in_dim(l, idx * k, k), plant.value))


@register(_jax.scan_p)
def _scan(scope, eqn, invals):
    p = _jax.Scan.of(eqn)
    body = p.body
    sites = scope.handled_sites([body.jaxpr])
    _no_strict(sites, "scan")
    nc, ncarry, length = p.num_consts, p.num_carry, p.length
    consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
    carried = scope.carried(sites, "scan")
    plants = scope.shifted_plants()
    holder = {}

    def step(carry, x):
        c, rec = carry
        idx, x = x
        body_plants = {
            path: _per_iteration(pl, idx, body.jaxpr, sites[path]) for path, pl in plants.items() if path in sites
        }
        child = scope.child({path: (carried[path][0], v) for path, v in rec.items()}, body_plants)
        outs = interpret(child, body.jaxpr, body.consts, [*consts, *c, *x])
        holder["child"] = child
        rec = {path: child.records[path].values[0] for path in carried}
        stacked = {
            path: _one_chunk(r) for path, r in child.records.items() if r.site.mode in LOOP_MODES
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
        site = sites[path]
        if site.mode == "collect":
            records[path] = Record(site, list(chunk))
        elif site.mode == "stack":
            records[path] = Record(site, [chunk])
        else:
            records[path] = Record(site, [jax.tree_util.tree_map(merge_rows, chunk)])
    # Entries of a collect name are stacked, so their count stays; rows of every
    # other mode repeat once per iteration.
    seen = {
        path: n if sites[path].mode in ("collect", "stack") else length * n for path, n in child.seen.items()
    }
    scope.absorb(records, seen)
    return [*c, *ys]


def _one_chunk(record: Record):
    """A scan body's occurrences of one name: a list of entries, or one chunk."""
    if record.site.mode == "collect":
        return list(record.values)
    if record.site.mode in ROW_MODES:
        return record.rows()
    return record.result()


@register(_jax.while_p)
def _while(scope, eqn, invals):
    p = _jax.While.of(eqn)
    cond, body = p.cond, p.body
    sites = scope.handled_sites([body.jaxpr])
    _no_strict(sites, "while_loop")
    for site in sites.values():
        if site.mode in LOOP_MODES:
            raise ValueError(
                f"The sow site {site} has mode {mode_label(site.mode)} inside a while_loop, whose trip "
                "count is not known until it runs, so its occurrences cannot be stacked into "
                "a fixed-size array. Use lax.scan (or fori_loop with static bounds), mode "
                "'clobber' for the last iteration, sow_cond for a chosen one, or "
                "harvest.stream to see every iteration on the host."
            )
    for site in scope.handled_sites([cond.jaxpr]).values():
        raise ValueError(
            f"The sow site {site} sits in a while_loop's cond_fun. Sow the value in "
            "body_fun instead."
        )
    for path in sites:
        if path in scope.plants and scope.plants[path].takes_index():
            raise ValueError(
                f"The planted callable for the sow site {sites[path]} takes an occurrence index, "
                "but the site is inside a while_loop, whose iterations are not counted. Use "
                "lax.scan (or fori_loop with static bounds), or a callable of the old value alone."
            )
    ncc, nbc = p.cond_nconsts, p.body_nconsts
    cconsts, bconsts, init = invals[:ncc], invals[ncc : ncc + nbc], invals[ncc + nbc :]
    # vmap of a loop whose predicate differs per example: JAX stages a while
    # whose cond gives one bool per example; it runs while any holds, and each
    # example keeps its carry (batch axes first) once its own fails. The
    # records ride in that carry, per example, and the loop is re-bound as
    # staged, so an outer harvest of what this walk re-emits sees the same.
    batch = cond.out_avals[0].shape
    carried = scope.carried(sites, "while_loop", batch)

    def cond_fn(carry):
        (out,) = interpret(scope.child(plants={}), cond.jaxpr, cond.consts, [*cconsts, *carry[0]])
        return out

    def body_fn(carry):
        c, rec = carry
        child = scope.child({path: (carried[path][0], v) for path, v in rec.items()})
        outs = interpret(child, body.jaxpr, body.consts, [*bconsts, *c])
        new = {path: child.records[path].values[0] for path in carried}
        if batch:  # per example, whether or not vmap batched the value
            new = {path: carried[path][0].fit(v, "while_loop", batch) for path, v in new.items()}
        return outs, new

    rec0 = {path: value for path, (_, value) in carried.items()}
    loop = _while_per_example if batch else lax.while_loop
    c, rec = loop(cond_fn, body_fn, (list(init), rec0))
    scope.absorb({path: Record(carried[path][0], [v]) for path, v in rec.items()}, {})
    return c


def _while_per_example(cond_fn, body_fn, init):
    """`lax.while_loop`, for a `cond_fn` that gives one bool per example."""
    leaves, tree = jax.tree_util.tree_flatten(init)
    # The carry's types must match exactly, so no weak types on either side.
    strong = lambda xs: [lax.convert_element_type(x, jnp.result_type(x)) for x in xs]
    leaves = strong(leaves)
    unflatten = functools.partial(jax.tree_util.tree_unflatten, tree)
    cond = jax.make_jaxpr(lambda *xs: cond_fn(unflatten(xs)))(*leaves)
    body = jax.make_jaxpr(lambda *xs: strong(jax.tree_util.tree_leaves(body_fn(unflatten(xs)))))(*leaves)
    return unflatten(_jax.bind_while(cond, body, leaves))
