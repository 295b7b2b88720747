"""Where a jaxpr sows: one index per jaxpr, built once and cached.

`sow_index(jaxpr)` walks the jaxpr and the bodies its equations hold (as their
descriptors in `_higher_order` give them) and records, in explicit fields,
what the rest of harvest asks: which sites are reachable at all (the walk
decides from it whether an equation needs its rule), which names (occurrence
counting skips bodies that sow nothing), and the sows that fire in a call, in
program order, with where they sit and how often they fire (`sites`, site
discovery, the names a walk files). A body's index is built once and reused
by every jaxpr that holds it (a library's jitted helper called many times).

The sows of custom_jvp rules are not indexed: a rule is traced only where JAX
differentiates (see `_interpreter.program_sites`).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from ._higher_order import UNBOUNDED, bodies
from ._primitive import sow_p
from ._site import Site


@dataclasses.dataclass(frozen=True)
class Listed:
    """One sow equation that fires when the jaxpr runs, as seen from that jaxpr.

    Attributes:
        eqn: the sow equation.
        where: the labels of the bodies around it (``("jit", "scan[12]")``).
        fires: how many times one run of the jaxpr sows there (None: inside a
            while_loop, not known before running).
        stacked: how many of those firings reap stacks as rows whatever the mode
            (one per shard of each shard_map around it; 1 elsewhere).
        blocks: a key per enclosing body, ``(id(eqn), label)`` (two scans of one
            length share a label, not a key).
    """

    eqn: Any
    where: tuple[str, ...]
    fires: int | None
    stacked: int
    blocks: tuple[tuple[int, str], ...]


@dataclasses.dataclass(frozen=True)
class SowIndex:
    """Where one jaxpr sows, through every body it holds.

    Attributes:
        sites: every site reachable, in any body (even one that runs only where
            JAX differentiates, such as a linear solve's transpose).
        names: ``(tag, path)`` of each of ``sites``.
        listing: the sows that fire in a run, in program order (a sow a batched
            cond copies out of its branches, ``role="record_only"``, left out).
    """

    sites: frozenset[Site]
    names: frozenset[tuple[Any, tuple[str, ...]]]
    listing: tuple[Listed, ...]


_INDEX: weakref.WeakKeyDictionary[Any, SowIndex] = weakref.WeakKeyDictionary()


def sow_index(jaxpr: Any) -> SowIndex:
    """The `SowIndex` of `jaxpr` (an open jaxpr), built once per jaxpr object."""
    try:
        return _INDEX[jaxpr]
    except KeyError:
        pass
    sites: set[Site] = set()
    listing: list[Listed] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            site = Site.of(eqn)
            sites.add(site)
            if eqn.params.get("role") != "record_only":
                listing.append(Listed(eqn, (), 1, 1, ()))
            continue
        for body in bodies(eqn):
            inner = sow_index(body.jaxpr)
            sites |= inner.sites
            runs = body.runs
            if runs == 0 and not body.stacked_loop:
                # Runs only where JAX differentiates: its sows do not fire in a call.
                # (A scan of length 0 is listed, firing 0 times, as reap gives 0 rows.)
                continue
            rows = runs if body.per_run_stacked and runs is not UNBOUNDED else 1
            key = ((id(eqn), body.label),)
            for item in inner.listing:
                fires = None if runs is UNBOUNDED or item.fires is None else runs * item.fires
                listing.append(
                    Listed(
                        item.eqn,
                        (body.label, *item.where),
                        fires,
                        rows * item.stacked,
                        key + item.blocks,
                    )
                )
    index = SowIndex(frozenset(sites), frozenset((s.tag, s.path) for s in sites), tuple(listing))
    _INDEX[jaxpr] = index
    return index


def sites_in(jaxpr: Any) -> frozenset[Site]:
    """Every site reachable from `jaxpr` (its index's `sites`)."""
    return sow_index(jaxpr).sites
