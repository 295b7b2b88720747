"""Loops: scan (and fori_loop with static bounds) and while_loop.

In a scan, `collect` and `append` occurrences become extra per-iteration
outputs, stacked on a leading axis index-aligned with the forward iterations;
`clobber` and `sow_cond` values ride in the carry, so the last one to fire
wins. A while loop has no fixed length, so everything it records rides in its
carry: the carried modes as in a scan, `instrument`'s sites as the last
iteration's record, and, under `max_steps`, every stacking mode as a buffer of
that many iterations plus the count of iterations run (`Steps`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ... import _jax
from .. import _errors
from .._higher_order import UNBOUNDED, Body, HigherOrder, register, split_extra
from .._interpreter import interpret
from .._modes import MODES
from .._occurrences import Record, select_where, stacked_record, varies
from .._steps import Steps
from .batched_cond import Occurrence, Stuck, rewrite


def _no_strict(sites, where):
    for site in sites.values():
        if site.mode.single and not site.mode.stacks_in_loops:
            every = " (with reap's max_steps=N)" if where == "while_loop" else ""
            raise ValueError(
                f"The sow site {site} has mode 'strict' but sits inside a {where}, which "
                "sows it once per iteration. "
                + (
                    _errors.random_variable_modes(site)
                    or "Use mode 'collect' or 'append' to keep every "
                    f"iteration{every}, 'clobber' for the last one, or sow_cond for a chosen one."
                )
            )


def _scan(walk, eqn, invals):
    p = _jax.Scan.of(eqn)
    body = p.body
    sites = walk.handled_sites([body.jaxpr])
    _no_strict(sites, "scan")
    nc, ncarry, length = p.num_consts, p.num_carry, p.length
    consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
    carried = walk.carried(sites, "scan")
    plants = {path: pl for path, pl in walk.shifted_plants().items() if path in sites}
    # A while_loop in the body makes an iteration's count of a name known only
    # as it runs: an index plant of it counts the rows before each iteration in the carry.
    counted = [path for path in _counted(plants, sites) if varies(body.jaxpr, sites[path])]
    if counted and p.reverse:
        raise _errors.index_after_while_in(sites[counted[0]], "reverse scan")
    holder = {}
    iteration = _iterations(walk, body, plants, sites, carried, length, "scan")

    def step(carry, x):
        c, rec, n = carry
        idx, x = x
        outs, holder["child"], rec, n = iteration(rec, n, idx, [*consts, *c, *x])
        child = holder["child"]
        stacked = {
            path: r.chunk() for path, r in child.records.items() if r.site.mode.stacks_in_loops
        }
        return (outs[:ncarry], rec, n), (outs[ncarry:], stacked)

    rec0 = {path: value for path, (_, value) in carried.items()}
    n0 = {path: jnp.int32(0) for path in counted}
    (c, rec, n), (ys, stacked) = _scan_like(p, step, (init, rec0, n0), (jnp.arange(length), xs))
    child = holder["child"]
    records = {path: Record(carried[path][0], [v]) for path, v in rec.items()}
    for path, chunk in stacked.items():
        records[path] = stacked_record(sites[path], chunk)
    # Stacked entries (and oryx's once-per-loop stacks) keep their count; every
    # other mode's occurrences repeat once per iteration.
    seen = {
        path: k if sites[path].mode.entries or sites[path].mode.stacks_per_loop else length * k
        for path, k in child.seen.items()
        if path not in n
    }
    walk.absorb(records, {**seen, **n})
    return [*c, *ys]


def _stacked_in_batched_while(site: Any) -> ValueError:
    return ValueError(
        f"The sow site {site} has mode {site.mode.label} inside a while_loop whose predicate "
        "vmap batches, so each example runs its own number of iterations. Reap per example "
        "instead: jax.vmap(reap(f))"
        + (
            ", or sow with mode 'clobber' for each example's last iteration."
            if site.mode.public
            else "."
        )
    )


def _while(walk, eqn, invals):
    p = _jax.While.of(eqn)
    cond, body = p.cond, p.body
    sites = walk.handled_sites([body.jaxpr])
    _no_strict(sites, "while_loop")
    for site in walk.handled_sites([cond.jaxpr]).values():
        raise ValueError(
            f"The sow site {site} sits in a while_loop's cond_fun. Sow the value in body_fun instead."
        )
    ncc, nbc = p.cond_nconsts, p.body_nconsts
    cconsts, bconsts, init = invals[:ncc], invals[ncc : ncc + nbc], invals[ncc + nbc :]
    # vmap of a loop whose predicate differs per example: JAX stages a while
    # whose cond gives one bool per example; it runs while any holds, and each
    # example keeps its carry (batch axes first) once its own fails. The
    # records ride in that carry, per example, and the loop is re-bound as
    # staged, so an outer harvest of what this walk re-emits sees the same.
    batch = cond.out_avals[0].shape
    carried = walk.carried(sites, "while_loop", batch)
    steps = walk.policy.max_steps
    # Stacking modes ride in the carry too: the last iteration's record
    # (instrument's sites, by default) or a buffer of `steps` iterations.
    stacked = {
        path: site
        for path, site in sites.items()
        if walk.reap and site.mode.stacks_in_loops and path not in walk.plants
    }
    for site in stacked.values():
        if steps is None and not site.mode.unstacked_once:
            raise ValueError(
                f"The sow site {site} has mode {site.mode.label} inside a while_loop, whose trip "
                "count is not known until it runs, so its occurrences cannot be stacked into "
                "a fixed-size array. "
                + (
                    "Pass max_steps=N to reap (or call_and_reap, harvest) for the first N iterations "
                    "and the count, or use "
                    if site.mode.public  # harvest.compat.oryx's reap takes no max_steps
                    else "Use "
                )
                + "lax.scan (or fori_loop with static bounds), mode 'clobber' for the last "
                "iteration, or sow_cond for a chosen one."
            )
        if batch and steps is not None:
            raise _stacked_in_batched_while(site)
    plants = {path: pl for path, pl in walk.shifted_plants().items() if path in sites}
    for path, pl in plants.items():
        if pl.per_occurrence():
            raise _errors.per_occurrence_plant_in_while(sites[path])
    counted = _counted(plants, sites)
    iteration = _iterations(walk, body, plants, sites, carried, UNBOUNDED, "while_loop")

    def run_body(c, rec, t, n):
        outs, child, new, n = iteration(rec, n, t, [*bconsts, *c])
        if batch:  # per example, whether or not vmap batched the value
            new = {path: carried[path][0].fit(v, "while_loop", batch) for path, v in new.items()}
        got = {path: child.records[path] for path in stacked if path in child.records}
        if steps is not None:
            return outs, new, {path: r.chunk() for path, r in got.items()}, n
        if batch:  # each example's last iteration: one value per iteration, as clobber keeps
            return outs, new, {path: [_last_per_example(r, batch)] for path, r in got.items()}, n
        return outs, new, {path: r.values for path, r in got.items()}, n

    def cond_fn(carry):
        (out,) = interpret(walk.child(plants={}), cond.jaxpr, cond.consts, [*cconsts, *carry[0]])
        return out

    def body_fn(carry):
        c, rec, kept, t, n = carry
        outs, new, now, n = run_body(c, rec, t, n)
        if steps is not None:
            now = jax.tree_util.tree_map(functools.partial(_write_row, t), kept, now)
        return outs, new, now, t + 1, n

    rec0 = {path: value for path, (_, value) in carried.items()}
    t0 = jnp.zeros(batch, jnp.int32)
    n0 = {path: t0 for path in counted}
    kept0 = {}
    if stacked:  # one abstract walk of the body gives the shapes its records take
        shapes = jax.eval_shape(lambda: run_body(list(init), rec0, t0, n0)[2])
        lead = () if steps is None else (steps + 1,)  # the last row: past `steps` (`_write_row`)
        kept0 = jax.tree_util.tree_map(lambda s: jnp.zeros(lead + s.shape, s.dtype), shapes)
    loop = _while_per_example if batch else lax.while_loop
    c, rec, kept, count, n = loop(cond_fn, body_fn, (list(init), rec0, kept0, t0, n0))
    records = {path: Record(carried[path][0], [v]) for path, v in rec.items()}
    for path, v in kept.items():
        if steps is None:
            records[path] = Record(sites[path], list(v))
        else:
            rows = jax.tree_util.tree_map(lambda b: b[:steps], v)
            records[path] = Record(
                sites[path], [Steps(stacked_record(sites[path], rows).result(), count)]
            )
    # A later sow of a name planted by index counts the occurrences the loop gave.
    walk.absorb(records, n)
    return c


def _iterations(walk, body, plants, sites, carried, runs, where):
    """`iteration(rec, n, idx, args)`, walking iteration `idx` of a loop's body on
    `args`, its clobber-like names starting from `rec`: (outputs, its walk, the
    new `rec`, the new `n`). A plant by index counted in the carry (`n`) sees the
    occurrences of the iterations before it; any other is sliced per iteration."""

    def iteration(rec, n, idx, args):
        body_plants = {
            path: pl.shift(n[path])
            if path in n
            else pl.per_iteration(idx, body.jaxpr, sites[path], runs, where)
            for path, pl in plants.items()
        }
        child = walk.child({path: (carried[path][0], v) for path, v in rec.items()}, body_plants)
        outs = interpret(child, body.jaxpr, body.consts, args)
        rec = {path: child.records[path].values[0] for path in carried}
        return outs, child, rec, {path: k + child.seen.get(path, 0) for path, k in n.items()}

    return iteration


def _counted(plants, sites):
    """The paths whose plants take the occurrence index and count rows one by one
    (not collect's entries nor oryx's once-per-loop stacks, which loops index alone)."""
    return [
        path
        for path, pl in plants.items()
        if pl.takes_index() and not (sites[path].mode.entries or sites[path].mode.stacks_per_loop)
    ]


def _write_row(t, buffer, row):
    """`buffer` with row `t` set to `row`, in place. The buffer has one row more
    than it records: iterations past the record all write that spare row, which
    is cut off after the loop, so a step writes one row and reads nothing (a
    select keeping the old row past the end, or a scatter that may drop, would
    cost a read or a copy of the buffer every step)."""
    return lax.dynamic_update_index_in_dim(buffer, row, jnp.minimum(t, buffer.shape[0] - 1), 0)


def _last_per_example(record, batch):
    """An iteration's one occurrence of `record`'s name, with `batch` axes in front."""
    site = record.site
    if len(record.values) != 1 or not site.one_occurrence(record.values[0]):
        raise _stacked_in_batched_while(site)
    return site.fit(record.values[0], "while_loop", batch)


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


# ---------------------------------------------------------------------------
# What the rest of harvest knows about scan and while_loop.


def _scan_body(eqn):
    p = _jax.Scan.of(eqn)
    return [
        Body(f"scan[{p.length}]", p.body.jaxpr, p.body.consts, runs=p.length, stacked_loop=True)
    ]


def _scan_forwards(eqn, i, position):
    """A carry returned as it came, or a slice of xs returned as y, is the input itself."""
    # Outputs: carries, then stacked ys; the body's inputs: consts, carries, xs.
    p = _jax.Scan.of(eqn)
    k = position(p.body.jaxpr, i)
    n, c = p.num_consts, p.num_carry
    return k if k is not None and ((i < c and k == n + i) or (i >= c and k >= n + c)) else None


def _scan_like(p, step, init, xs):
    """`lax.scan` of `step` with the options of the scan `p` (its length, direction, unroll)."""
    return lax.scan(step, init, xs, length=p.length, reverse=p.reverse, unroll=p.unroll)


def _restage_scan(eqn, invals, staged, extra):
    p = _jax.Scan.of(eqn)
    (body,) = _scan_body(eqn)
    run = staged(body)
    nc, ncarry = p.num_consts, p.num_carry
    consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]

    def step(carry, x):
        outs, more = split_extra(run(*consts, *carry[0], *x, *carry[1]), extra)
        return (outs[:ncarry], more), outs[ncarry:]

    (carry, more), ys = _scan_like(p, step, (list(init), list(extra)), list(xs))
    return [*carry, *ys, *more]


def _scan_in_batched_branch(
    eqn: Any, invals: list[Any], found: list[Occurrence], stuck: Stuck
) -> list[Any]:
    """A scan inside a branch: its body's values leave stacked, as reap stacks them."""
    p = _jax.Scan.of(eqn)
    nc, ncarry = p.num_consts, p.num_carry
    consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
    holder: dict[str, list[Occurrence]] = {}

    def step(carry: list[Any], x: list[Any]) -> Any:
        inner: list[Occurrence] = []
        outs = rewrite(p.body.jaxpr, list(p.body.consts), [*consts, *carry, *x], inner, stuck)
        holder["inner"] = inner = _merge_carried(inner)
        flagged = [(o.leaves, jnp.asarray(o.present, bool)) for o in inner]
        return outs[:ncarry], (outs[ncarry:], flagged)

    carry, (ys, stacked) = _scan_like(p, step, list(init), list(xs))
    for o, (leaves, present) in zip(holder["inner"], stacked):
        mode = MODES[o.params["mode"]]
        if mode.rows:  # one row per iteration, in order
            found.extend(
                Occurrence(o.params, [l[t] for l in leaves], present[t]) for t in range(p.length)
            )
        elif mode.carried:  # the last iteration that sowed it
            found.append(_last_sown(o, leaves, present, p.reverse))
        else:  # collect (strict is an error in a scan): one entry per sow in the body, stacked
            found.append(Occurrence(o.params, leaves, jnp.any(present), o.loops + 1))
    return [*carry, *ys]


def _merge_carried(found: list[Occurrence]) -> list[Occurrence]:
    """One occurrence per clobber-like name: the last one sown, and whether any was."""
    out: list[Occurrence] = []
    where: dict[tuple[Any, ...], int] = {}
    for o in found:
        i = where.get(o.key) if MODES[o.params["mode"]].carried else None
        if i is None:
            where[o.key] = len(out)
            out.append(o)
            continue
        prev = out[i]
        leaves = [select_where(o.present, n, m) for n, m in zip(o.leaves, prev.leaves)]
        out[i] = Occurrence(o.params, leaves, prev.present | o.present)
    return out


def _last_sown(o: Occurrence, leaves: list[Any], present: Any, reverse: bool) -> Occurrence:
    """Of `o`'s values stacked over iterations, the last iteration's run whose flag holds."""
    if reverse:  # the last iteration run is the first
        leaves, present = [l[::-1] for l in leaves], present[::-1]
    later = jnp.cumsum(present[::-1].astype(jnp.int32), axis=0)[::-1]  # flags set at t or after
    last = present & (later == 1)
    leaves = [
        jnp.sum(select_where(last, l, jnp.zeros_like(l)), axis=0).astype(l.dtype) for l in leaves
    ]
    return Occurrence(o.params, leaves, jnp.any(present, axis=0))


def _while_bodies(eqn):
    p = _jax.While.of(eqn)
    # The predicate reads its own consts and the carry, not the body's consts.
    ncc, nbc = p.cond_nconsts, p.body_nconsts
    predicate_reads = (*range(ncc), *range(ncc + nbc, len(eqn.invars)))
    return [
        Body(
            "while",
            p.cond.jaxpr,
            p.cond.consts,
            runs=UNBOUNDED,
            predicate=True,
            inputs=predicate_reads,
        ),
        Body("while", p.body.jaxpr, p.body.consts, runs=UNBOUNDED),
    ]


def _while_forwards(eqn, i, position):
    """A carry the body returns as it came is the loop's input."""
    p = _jax.While.of(eqn)
    k = position(p.body.jaxpr, i)
    return None if k is None or k != p.body_nconsts + i else p.cond_nconsts + k


def _restage_while(eqn, invals, staged, extra):
    p = _jax.While.of(eqn)
    cond, body = (staged(b) for b in _while_bodies(eqn))
    ncc, nbc = p.cond_nconsts, p.body_nconsts
    cconsts, bconsts, init = invals[:ncc], invals[ncc : ncc + nbc], invals[ncc + nbc :]
    carry, more = lax.while_loop(
        lambda c: cond(*cconsts, *c[0], *c[1])[0],
        lambda c: split_extra(body(*bconsts, *c[0], *c[1]), extra),
        (list(init), list(extra)),
    )
    return [*carry, *more]


# ---------------------------------------------------------------------------
# Registration: one per primitive.

register(
    _jax.scan_p,
    HigherOrder(
        _scan_body,
        rule=_scan,
        forwards=_scan_forwards,
        restage=_restage_scan,
        batched_branch=_scan_in_batched_branch,
    ),
)
register(
    _jax.while_p,
    HigherOrder(_while_bodies, rule=_while, forwards=_while_forwards, restage=_restage_while),
)
