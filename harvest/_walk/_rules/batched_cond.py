"""Branches that vmap runs side by side: `cond`/`switch` with a batched predicate.

Under `vmap`, such a `cond` runs every branch on every example and selects
each output per example, so every branch's sows would fire for every example.
While a harvest traces, this module wraps that batching rule:

* each sow stays where it is but only takes plants (`role="plant_only"`), so a
  planted value still flows on through the branch that computed it;
* each branch also returns its sows' (post-plant) values in slots: slot `j` of
  a name holds its `j`-th occurrence and a flag saying whether the branch
  sowed it (zeros and False where it sows it fewer times), selected per
  example by JAX's rule along with the branch outputs;
* after the select, each slot is sown again with `role="record_only"`, to
  record the taken branch's value per example (inside `lax.map(f, xs,
  batch_size=b)`, once per element, see `batched_lax_map`).

Markers (`branch_p`) before each branch and after the last let every branch
count occurrences from the same point, and the `cond` count as its longest
branch. A scan's values leave it stacked, as reap stacks them. Sows inside a
`while_loop` or a custom derivative there cannot leave as slots: they still
take plants, and a walk that would record one says so.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ... import _jax
from .._evaluator import evaluate
from .._higher_order import HigherOrder, describe, register
from .._interpreter import Walk
from .._occurrences import most_count
from .._paths import path_str
from .._primitive import sow_effect, sow_p, tracing_a_harvest
from .._site import Site
from .._sow_index import sites_in
from . import batched_lax_map

LAST = -1  # the `branch` of the marker after the last branch

branch_p = _jax.Primitive("harvest_branch")
branch_p.multiple_results = True
branch_p.def_impl(lambda **params: [])
# The effect keeps markers through dead-code elimination; they exist only while a harvest traces.
branch_p.def_effectful_abstract_eval(lambda **params: ([], {sow_effect}))
_jax.register_lowering(branch_p, lambda ctx, **params: [])
_jax.jvp_rules[branch_p] = lambda primals, tangents, **params: (branch_p.bind(**params), [])
_jax.jet_rules[branch_p] = lambda primals, series, **params: (branch_p.bind(**params), [])
_jax.register_batching(
    branch_p, lambda axis_data, args, dims, **params: (branch_p.bind(**params), [])
)

_groups = itertools.count()

# ---------------------------------------------------------------------------
# Rewriting a branch: sows take plants in place, their values leave as outputs.


@dataclasses.dataclass
class Occurrence:
    params: dict[str, Any]  # the sow's params, without a role
    leaves: list[Any]
    present: Any  # whether it was sown (for sow_cond: and its pred held)
    loops: int = 0  # leading axes the leaves gained from scans (collect entries)

    @property
    def key(self) -> tuple[Any, ...]:
        p = self.params
        return (p["tag"], p["scope"], p["name"], p["mode"])


# The sites a branch cannot bring out, each with the name of the primitive it sits in.
Stuck = set[tuple[Site, str]]


def rewrite(
    jaxpr: _jax.Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    found: list[Occurrence],
    stuck: Stuck,
) -> list[Any]:
    """Evaluates `jaxpr`, its sows made plant-only and their values appended to `found`;
    the sites it cannot bring out (inside while loops, custom derivatives) go to `stuck`."""

    def step(eqn: Any, invals: list[Any]) -> Any:
        if eqn.primitive is sow_p and eqn.params.get("role") == "unplantable":
            # A custom_vmap body's sow, shown where its batching rule ran (see
            # `_rules/custom_vmap`): it cannot leave the branch as a slot.
            stuck.add((Site.of(eqn), "custom_vmap_call"))
            return sow_p.bind(*invals, **eqn.params)
        if eqn.primitive is sow_p:
            return _rewrite_sow(eqn, invals, found)
        subs = _jax.sub_jaxprs(eqn)
        if not any(sites_in(j) for j in subs):
            return _jax.rebind(eqn, invals)
        how = describe(eqn)
        if how.batched_branch is not None:
            return how.batched_branch(eqn, invals, found, stuck)
        if how.inlinable:  # as if inlined: a jit's boundary, a checkpoint's policy dropped here
            (body,) = how.bodies(eqn)
            return rewrite(body.jaxpr, body.consts, invals, found, stuck)
        stuck.update((site, eqn.primitive.name) for j in subs for site in sites_in(j))
        return _jax.rebind(eqn, invals)

    return evaluate(jaxpr, consts, args, step)


def _rewrite_sow(eqn: Any, invals: list[Any], found: list[Occurrence]) -> list[Any]:
    params = dict(eqn.params)
    role = params.pop("role", None)
    n = len(eqn.outvars)
    if role == "plant_only":  # an inner batched cond's, already brought out by it
        return list(sow_p.bind(*invals, **eqn.params))
    if role == "record_only":  # records of a vmap inside this branch: they leave as slots
        found.append(Occurrence(params, invals[:n], invals[n]))
        return invals[:n]
    outs = list(sow_p.bind(*invals, **params, role="plant_only"))
    found.append(Occurrence(params, outs, invals[n] if len(invals) > n else True))
    return outs


# ---------------------------------------------------------------------------
# Uniting branches: every one returns the same slots.


@dataclasses.dataclass(frozen=True)
class _Slot:
    params: dict[str, Any]  # of the sow that first fills it
    avals: tuple[Any, ...]  # the value's leaves, then its flag
    loops: int  # as its occurrences'

    def layout(self) -> tuple[Any, ...]:
        return self.params["tree"], [(a.shape, a.dtype) for a in self.avals[:-1]], self.loops


def united(branches: tuple[Any, ...], group: int | None) -> tuple[list[Any], list[_Slot], Stuck]:
    """Each branch rewritten to also return the slots of every branch; with a
    `group`, each starts with its marker. Returns (branches, slots, stuck sites)."""
    specs = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in branches[0].in_avals
    ]
    n_outs = len(branches[0].out_avals)
    traced: list[tuple[Any, dict[Any, _Slot]]] = []
    stuck: Stuck = set()
    for b, br in enumerate(branches):
        found: list[Occurrence] = []

        def walk(*ops: Any, br: Any = br, found: list[Occurrence] = found, b: int = b) -> list[Any]:
            if group is not None:
                branch_p.bind(group=group, branch=b, stuck=())
            outs = rewrite(br.jaxpr, list(br.consts), list(ops), found, stuck)
            return [*outs, *(x for o in found for x in (*o.leaves, jnp.asarray(o.present, bool)))]

        closed = jax.make_jaxpr(walk)(*specs)
        # Slot (name, j): the j-th occurrence of the name in this branch.
        mine: dict[Any, _Slot] = {}
        avals = closed.out_avals[n_outs:]
        for occ in found:
            j = sum(key[0] == occ.key for key in mine)
            k = len(occ.leaves) + 1
            mine[(occ.key, j)], avals = _Slot(occ.params, tuple(avals[:k]), occ.loops), avals[k:]
        traced.append((closed, mine))

    slots: dict[Any, _Slot] = {}  # in the order names first occur
    for _, mine in traced:
        for key, slot in mine.items():
            known = slots.setdefault(key, slot)
            if known.layout() != slot.layout():
                p = slot.params
                name = path_str((*p["scope"], p["name"]))
                raise ValueError(
                    f"The sow site tag={p['tag']!r}, name={name!r} is sown with different shapes in "
                    "different branches of a cond whose predicate vmap batches. Sow the same shapes "
                    "in every branch, or use different names."
                )
            flag = jax.ShapeDtypeStruct(
                np.broadcast_shapes(known.avals[-1].shape, slot.avals[-1].shape), bool
            )
            slots[key] = dataclasses.replace(known, avals=(*known.avals[:-1], flag))

    def padded(closed: Any, mine: dict[Any, _Slot]) -> Any:
        def fn(*ops: Any) -> list[Any]:
            flat = _jax.eval_jaxpr(closed.jaxpr, closed.consts, *ops)
            outs, rest = flat[:n_outs], flat[n_outs:]
            have = {}
            for key, slot in mine.items():  # in the order this branch sowed them
                k = len(slot.avals)
                have[key], rest = rest[:k], rest[k:]
            extra: list[Any] = []
            for key, slot in slots.items():
                # A slot this branch does not fill: zeros, and False.
                values = have.get(key) or [jnp.zeros(a.shape, a.dtype) for a in slot.avals]
                extra.extend(values[:-1])
                extra.append(jnp.broadcast_to(values[-1], slot.avals[-1].shape))
            return [*outs, *extra]

        return fn

    new = [jax.make_jaxpr(padded(closed, mine))(*specs) for closed, mine in traced]
    return new, list(slots.values()), stuck


def unpack(slots: list[_Slot], flat: list[Any]) -> list[Occurrence]:
    """The occurrences that slots hold, from their flattened values."""
    found = []
    for slot in slots:
        k = len(slot.avals)
        found.append(Occurrence(slot.params, list(flat[: k - 1]), flat[k - 1], slot.loops))
        flat = flat[k:]
    return found


# ---------------------------------------------------------------------------
# The batching rule.


def _batch_cond(
    jax_rule: Any, axis_data: Any, args: Any, dims: Any, *, branches: Any, **params: Any
) -> Any:
    if (
        dims[0] is None
        or "branches_platforms" in params
        or not tracing_a_harvest()
        or not any(sites_in(b.jaxpr) for b in branches)
    ):
        return jax_rule(axis_data, args, dims, branches=branches, **params)
    group = next(_groups)
    new, slots, stuck = united(tuple(branches), group)
    outs, out_dims = jax_rule(axis_data, args, dims, branches=tuple(new), **params)
    n = len(branches[0].out_avals)
    branch_p.bind(group=group, branch=LAST, stuck=tuple(sorted(stuck, key=str)))
    extra = [_jax.bdim_at_front(x, d, axis_data) for x, d in zip(outs[n:], out_dims[n:])]
    for occ in unpack(slots, extra):
        _record(occ, axis_data)
    return outs[:n], out_dims[:n]


def _record(occ: Occurrence, axis_data: Any) -> None:
    """Sows `occ`, selected per example (the batch axis in front), record-only."""
    # Sown out here, not in the branch: the vmaps in the branch are not counted.
    counted = {k: v for k, v in occ.params.items() if k != "vmaps"}
    params, part = batched_lax_map.at_level(counted, axis_data)
    if part is not None:
        # Inside lax.map(f, xs, batch_size=b): one record per element, as
        # lax.map(f, xs) sows them (the branch's own sows were sown so to take plants).
        size = axis_data.size
        for j in range(size):
            leaves = [leaf[j] for leaf in occ.leaves]
            params_j = batched_lax_map.element_params(params, j, size, part)
            sow_p.bind(*leaves, occ.present[j], **dict(params_j, role="record_only"))
        return
    k = len(occ.leaves)
    vmapped = tuple(v + 1 for v in params.get("vmapped") or (0,) * k)
    # The batch axis goes after a scan's, as reap(vmap(f)) stacks a scan's batched values.
    leaves = [jnp.moveaxis(leaf, 0, occ.loops) for leaf in occ.leaves]
    sow_p.bind(*leaves, occ.present, **dict(params, vmapped=vmapped, role="record_only"))


_jax.wrap_batching(_jax.cond_p, _batch_cond)


# ---------------------------------------------------------------------------
# The walk at a marker.


def recount(eqn: Any, n: int, groups: dict[int, tuple[int, int]]) -> int:
    """The occurrences of a name counted so far, `n`, after a marker: each
    branch counts from where the first began, and the cond as its longest."""
    p = eqn.params
    if p["branch"] == 0:
        groups[p["group"]] = (n, n)
    start, most = groups[p["group"]]
    groups[p["group"]] = (start, max(most, n))
    return max(most, n) if p["branch"] == LAST else start


_counts: weakref.WeakKeyDictionary[Walk, dict[int, tuple[dict[Any, int], dict[Any, int]]]] = (
    weakref.WeakKeyDictionary()
)


def _marker(walk: Walk, eqn: Any, invals: list[Any]) -> list[Any]:
    p = eqn.params
    groups = _counts.setdefault(walk, {})
    if p["branch"] == 0:
        groups[p["group"]] = (dict(walk.seen), {})
    start, most = groups[p["group"]]
    for path, n in walk.seen.items():
        most[path] = most_count(most.get(path, 0), n)
    walk.seen.clear()
    walk.seen.update(most if p["branch"] == LAST else start)
    stuck = p["stuck"]
    if p["branch"] == LAST:
        del groups[p["group"]]
        stuck = tuple(pair for pair in stuck if not _harvested(walk, *pair))
    # What is left goes to an outer harvest, its names as it will see them.
    stuck = tuple(
        (dataclasses.replace(s, path=walk.policy.prefix + s.path), where) for s, where in stuck
    )
    return list(branch_p.bind(**dict(p, stuck=stuck)))


def _stuck_in_batched_branch(site: Any, where: str) -> NotImplementedError:
    """`where`: the primitive the sow sits in (``"while"``, a custom rule's, a user's)."""
    known = {
        "while": "a while_loop",
        "custom_jvp_call": "a custom_jvp function",
        "custom_vjp_call": "a custom_vjp function",
        "custom_vmap_call": "a custom_vmap function",
    }
    fix = "move the sow out of that body"
    if where not in known:
        fix = (
            f"if `{where}` runs its one body once on its inputs, register it with "
            "harvest.extend.HigherOrder(..., call=True), so harvest inlines it there; "
            "otherwise give its HigherOrder a `batched_branch` that runs its bodies through "
            "harvest.extend.walk_in_branch (see harvest.extend)"
        )
    inside = known.get(where, f"the primitive `{where}`")
    return NotImplementedError(
        f"The sow site {site} is inside {inside} within a branch of a cond whose predicate "
        "vmap batches: every branch runs for every example, and harvest cannot carry the value "
        "out of that body to record the taken branch's. Harvest per example instead, "
        f"jax.vmap(reap(f)), or {fix}."
    )


def _harvested(walk: Walk, site: Site, where: str) -> bool:
    """Whether this walk has planted a stuck site (in every branch, as it should);
    one it would record instead is an error, one it leaves alone is not."""
    key = walk.policy.key(site)
    if not walk.policy.handles(site) or (not walk.reap and key not in walk.plants):
        return False
    if key in walk.plants:
        return True
    raise _stuck_in_batched_branch(site, where)


# A marker: no bodies, a rule the walk runs at each one, and how it moves counts.
register(branch_p, HigherOrder(lambda eqn: [], rule=_marker, recount=recount))
