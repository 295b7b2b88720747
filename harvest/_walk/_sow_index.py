"""Where a jaxpr sows: one index per jaxpr object, built once through the bodies
its equations hold (a library's jitted helper called many times is indexed once).

It answers what the rest of harvest asks: which sites are reachable (whether an
equation needs its rule), which names (occurrence counting skips bodies that sow
nothing), and which sows fire in a call, in program order (`sites`, site
discovery). The sows of custom_jvp rules are not indexed: a rule is traced only
where JAX differentiates (see `_interpreter.program_sites`).
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
    """One sow equation that fires when the jaxpr runs, as seen from that jaxpr."""

    eqn: Any
    where: tuple[str, ...]  # the labels of the bodies around it: ("jit", "scan[12]")
    fires: int | None  # how often one run of the jaxpr sows there (None: in a while_loop)
    stacked: int  # of those, how many reap stacks as rows whatever the mode (shard_map's)
    # A key per enclosing body, (id(eqn), label): two scans of one length share a label.
    blocks: tuple[tuple[int, str], ...]


@dataclasses.dataclass(frozen=True)
class SowIndex:
    """Where one jaxpr sows, through every body it holds."""

    # Every site reachable, in any body (even one that runs only where JAX
    # differentiates, such as a linear solve's transpose), and their (tag, path).
    sites: frozenset[Site]
    names: frozenset[tuple[Any, tuple[str, ...]]]
    # The sows that fire in a run, in program order (without a batched cond's copies).
    listing: tuple[Listed, ...]


_INDEX: weakref.WeakKeyDictionary[Any, SowIndex] = weakref.WeakKeyDictionary()


def sow_index(jaxpr: Any) -> SowIndex:
    """The `SowIndex` of `jaxpr` (an open jaxpr), built once per jaxpr object."""
    if jaxpr in _INDEX:
        return _INDEX[jaxpr]
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
                where, blocks = (body.label, *item.where), key + item.blocks
                listing.append(Listed(item.eqn, where, fires, rows * item.stacked, blocks))
    index = SowIndex(frozenset(sites), frozenset((s.tag, s.path) for s in sites), tuple(listing))
    _INDEX[jaxpr] = index
    return index


def sites_in(jaxpr: Any) -> frozenset[Site]:
    """Every site reachable from `jaxpr` (its index's `sites`)."""
    return sow_index(jaxpr).sites
