"""Many devices: shard_map (and pmap, which JAX stages as a shard_map).

Inside a shard_map body every value is one shard's. A sow there is reaped
stacked along a new leading mesh axis, one row per shard in mesh order (a
per-shard scalar becomes a vector of shape `(num_shards,)`); collect entries
are stacked the same way and append rows are concatenated shard by shard.
The reaped arrays leave the body sharded along that axis, so nothing is
gathered onto one device. A planted value is either one value for every
shard, or stacked the same way as reaped, one row per shard.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ... import _jax
from .._higher_order import Body, HigherOrder, register
from .._interpreter import interpret
from .._occurrences import stacked_record, static_counts


def _lift(site, shards):
    """The site as seen outside the shard_map: one row per shard in front."""
    avals = tuple(a.update(shape=(shards,) + a.shape) for a in site.avals)
    return dataclasses.replace(site, avals=avals)


def _per_shard(eqn):
    p = _jax.ShardMap.of(eqn)
    return [Body("shard_map", p.body, runs=p.shards, per_run_stacked=True)]


def _row_index(mesh, axes, varying):
    """The row of a per-shard stack (rows in mesh order over `axes`) this shard
    reads, for a value varying over `varying` only: along the other axes every
    shard holds the same value, so it reads the row at index 0 there, and the
    planted value varies over exactly the axes the sown one did."""
    idx, stride = 0, 1
    for axis in reversed(axes):
        if axis in varying:
            idx = idx + lax.axis_index(axis) * stride
        stride *= mesh.shape[axis]
    return idx


def _shard_map(walk, eqn, invals):
    p = _jax.ShardMap.of(eqn)
    body, axes, shards = p.body, p.axes, p.shards
    sites = walk.handled_sites([body])
    plants = walk.shifted_plants()

    holder = {}

    def per_shard(*args):
        # Each shard reads its own row of a plant stacked per shard.
        def plant_row(pl, site):
            # The manual mesh axes the sown value varies over; without check_vma JAX
            # tracks none: every shard reads its own row.
            varying = frozenset(axes)
            if p.check_vma:
                varying = frozenset().union(*map(_jax.varying_of, site.avals))
            idx = _row_index(p.mesh, axes, varying)
            if pl.site.mode.stacks_in_loops:
                return pl.per_iteration(idx, body, site, shards, "shard_map")
            return pl.peel(idx, shards, "shard_map")

        child = holder["child"] = walk.child(
            plants={
                path: plant_row(pl, sites[path]) for path, pl in plants.items() if path in sites
            }
        )
        outs = interpret(child, body, (), args)

        # One leading row per shard, so the out_spec lays the rows along `axes`.
        def row(x):
            x = jnp.expand_dims(x, 0)
            return _jax.pcast_varying(x, axes) if p.check_vma else x

        rows = {
            path: rec.rows() if rec.site.mode.rows else rec.result()
            for path, rec in child.records.items()
        }
        return tuple(outs), jax.tree_util.tree_map(row, rows)

    outs, exported = jax.shard_map(
        per_shard,
        mesh=p.mesh,
        in_specs=p.in_specs,
        out_specs=(p.out_specs, P(axes)),
        axis_names=set(axes),
        check_vma=p.check_vma,
    )(*invals)
    child = holder["child"]
    records, seen = {}, {}
    for path, value in exported.items():
        # Rows of all shards become one run of rows; any other value gains a leading axis.
        site = child.records[path].site
        records[path] = stacked_record(site if site.mode.rows else _lift(site, shards), value)
    for path, n in static_counts(child.seen, sites, "shard_map").items():
        mode = sites[path].mode
        seen[path] = n if mode.entries else shards * n if mode.rows else 1
    walk.absorb(records, seen)
    return list(outs)


register(_jax.shard_map_p, HigherOrder(_per_shard, rule=_shard_map))
