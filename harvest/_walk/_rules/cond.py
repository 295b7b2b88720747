"""Branches: cond and switch.

Only the taken branch runs, but every branch must return the same structure.
So each branch's walk is traced once to learn what it records, then every
branch returns the union: a name that the taken branch did not sow comes back
as zeros (collect entries and append rows are zero-filled up to the longest
branch), while `clobber`/`sow_cond` values that a branch does not touch keep
their value from before the cond. To know which branch ran, sow the branch
index yourself (see the docs' semantics table).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ... import _jax
from .. import _errors
from .._higher_order import Body, HigherOrder, register
from .._interpreter import interpret
from .._occurrences import Record, static_counts
from .._steps import Steps
from .batched_cond import Occurrence, Stuck, united, unpack


def _zeros(shape):
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shape)


def _layout(shape):
    leaves = jax.tree_util.tree_leaves(shape)
    return jax.tree_util.tree_structure(shape), [(l.shape, l.dtype) for l in leaves]


def _union(shapes, site):
    """The record structure every branch returns for one name, as shapes."""
    mode = site.mode
    present = [s for s in shapes if s is not None]
    if any(isinstance(s, Steps) for s in present):  # a while_loop's, recorded per step
        raise _errors.steps_nested(site)
    # Collect entries: each branch's are a prefix of the longest's.
    union = max(present, key=len) if mode.entries else present[0]
    if mode.rows and not all(site.one_occurrence(s) for s in present):
        rows = max(
            1 if site.one_occurrence(s) else jax.tree_util.tree_leaves(s)[0].shape[0]
            for s in present
        )
        return site.zeros_shape((rows,))  # else one unstacked value, as for the modes below
    if any(_layout(s) != _layout(union[: len(s)] if mode.entries else union) for s in present):
        raise ValueError(
            f"The sow site {site} is sown with different shapes in different branches "
            "of a cond. Sow the same shapes in every branch, or use different names."
        )
    return union


def _pad(value, union, site):
    if value is None:
        return _zeros(union)
    if site.mode.entries:
        return list(value) + [_zeros(u) for u in union[len(value) :]]
    if site.mode.rows and not site.one_occurrence(union):
        if site.one_occurrence(value):
            value = jax.tree_util.tree_map(lambda v: jnp.expand_dims(v, 0), value)

        def padded(v, u):
            zeros = jnp.zeros((u.shape[0] - v.shape[0],) + v.shape[1:], v.dtype)
            return jnp.concatenate([v, _jax.retype(zeros, v)])

        return jax.tree_util.tree_map(padded, value, union)
    return value


def _cond(walk, eqn, invals):
    branches = _jax.cond_branches(eqn)
    index, ops = invals[0], invals[1:]
    sites = walk.handled_sites([b.jaxpr for b in branches])
    carried = walk.carried(sites, "cond")
    plants = walk.shifted_plants()

    traced = []
    for br in branches:
        child = walk.child(carried, plants)

        def walk_branch(*ops, br=br, child=child):
            outs = interpret(child, br.jaxpr, br.consts, ops)
            # One entry per name: a list of entries for collect, one array otherwise.
            recs = child.records.items()
            return outs, {p: list(r.values) if r.site.mode.entries else r.result() for p, r in recs}

        closed, shape = jax.make_jaxpr(walk_branch, return_shape=True)(*ops)
        traced.append((closed, shape, child))

    paths = sorted({p for _, shape, _ in traced for p in shape[1]})
    union = {p: _union([shape[1].get(p) for _, shape, _ in traced], sites[p]) for p in paths}

    def branch_fn(closed, shape, types=None):
        def fn(*ops):
            flat = _jax.eval_jaxpr(closed.jaxpr, closed.consts, *ops)
            outs, recs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), flat)
            padded = {p: _pad(recs.get(p), union[p], sites[p]) for p in paths}
            if types is not None:
                padded = jax.tree_util.tree_map(_jax.retype, padded, *types)
            return outs, padded

        return fn

    types = None
    # The jaxpr's avals, not make_jaxpr's shapes: JAX 0.8's shapes drop the sharding.
    record_avals = [
        a for c, s, _ in traced for a in c.out_avals[len(jax.tree_util.tree_leaves(s[0])) :]
    ]
    if any(map(_jax.mesh_typed, record_avals)):
        # Every branch returns each record typed alike (sharding under Explicit
        # mesh axes, varying axes inside shard_map): as the first branch that
        # sows it, varying over the axes any branch's varies over.
        padded = [jax.eval_shape(branch_fn(c, s), *ops)[1] for c, s, _ in traced]
        children = [child for _, _, child in traced]
        sowing = {p: [pad[p] for pad, c in zip(padded, children) if c.seen.get(p)] for p in paths}
        like = {p: sowing[p][0] if sowing[p] else padded[0][p] for p in paths}
        axes = jax.tree_util.tree_map(
            lambda *shapes: frozenset().union(*map(_jax.varying_of, shapes)), *padded
        )
        types = (like, axes)
    outs, recs = lax.switch(index, [branch_fn(c, s, types) for c, s, _ in traced], *ops)
    records = {
        p: Record(sites[p], list(v) if sites[p].mode.entries else [v]) for p, v in recs.items()
    }
    seen = {}
    for _, _, child in traced:
        for p, n in static_counts(child.seen, sites, "cond").items():
            seen[p] = max(seen.get(p, 0), n)
    walk.absorb(records, seen)
    return outs


# ---------------------------------------------------------------------------
# What the rest of harvest knows about cond.


def _branches(eqn):
    return [Body(f"cond[{i}]", b.jaxpr, b.consts) for i, b in enumerate(_jax.cond_branches(eqn))]


def _forwards(eqn, i, position):
    """An output every branch copies from the same operand is that operand."""
    ks = {position(b.jaxpr, i) for b in _jax.cond_branches(eqn)}
    k = ks.pop() if len(ks) == 1 else None
    return None if k is None else 1 + k  # input 0 is the branch index


def _restage(eqn, invals, staged, extra):
    # Each branch takes the operands then `extra`, and returns its outputs then `extra`'s.
    return list(lax.switch(invals[0], [staged(b) for b in _branches(eqn)], *invals[1:], *extra))


def _in_batched_branch(
    eqn: Any, invals: list[Any], found: list[Occurrence], stuck: Stuck
) -> list[Any]:
    """A cond inside a branch, its branches rewritten: its slots join the outer branch's."""
    branches = _jax.cond_branches(eqn)
    new, slots, inner_stuck = united(branches, group=None)
    stuck.update(inner_stuck)
    outs = _jax.bind_with(_jax.cond_p, dict(eqn.params, branches=tuple(new)), invals)
    found.extend(unpack(slots, outs[len(branches[0].out_avals) :]))
    return list(outs[: len(branches[0].out_avals)])


register(
    _jax.cond_p,
    HigherOrder(
        _branches,
        rule=_cond,
        alternatives=True,
        forwards=_forwards,
        restage=_restage,
        batched_branch=_in_batched_branch,
    ),
)
