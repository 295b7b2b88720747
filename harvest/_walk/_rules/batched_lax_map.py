"""`lax.map(f, xs, batch_size=b)`: its sows, one per element, as without `batch_size`.

JAX runs such a map as a scan over batches of `b` elements, `f` vmapped over
each batch, then `f` vmapped over the remainder. A sow in `f` would fire once
per batch, so what is reaped, and where plant rows land, would depend on `b`,
a memory knob. Instead, where a walk handles such a sow, `f` is traced again
(`_transforms`) with the sow's batching rule unrolled: each batch binds one
sow per element, in element order, and stacks their values back. The walk
then sees the occurrences of `lax.map(f, xs)`: one per element, the
remainder's last (a callable plant sees one element). A collect sow's entries
carry which element they are (the `element` param), for the walk to merge them
into the one entry `lax.map(f, xs)` stacks (`_occurrences.merged_elements`)
and split a plant back. Refused: a sow in a loop inside `f` (the loop runs each
step for the whole batch, so occurrences would come step by step), and a rows
name sown more than once per element (its unrolled sows carry which vmap of
`f` unrolled them, for the walk to count).

How the map is found: `lax.map` passes `vmap` no axis name, so only the code
that staged it tells it apart: the traceback JAX records for each equation
(`eqn.source_info`), read after tracing. JAX records frames back to the
nearest call from C++ only, so a sow's frames are its own followed by those of
each equation around it (where a release records a body's frames past its
entry, those from its call site on are the holder's). Where they show a
`jax.vmap` called by `lax.map` (at lines read once from its code,
`_jax.lax_map_layout`), the sow is under a batched map. Three traces:

1. the walk's own: which sites some batched map holds (`staged_per_batch`);
2. those sites' sows number the `jax.vmap` calls that batch them, innermost
   first (the `vmaps` param), each number matched to the call the sow's frames
   show in its place (`_planned`; a branch JAX re-runs inline, whose frames are
   those of its first run, is not read), saying whether that vmap is a map's
   and which part; a sow with a vmap matched nowhere is refused;
3. with that plan (`Plan`), the batching rule unrolls a sow batched by a map's
   vmap, knowing the vmap by its number.

Traces 2 and 3 number the vmap calls alike, as each runs with a trace value of
its own (so JAX reuses no trace across them) and both run the same code.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from ... import _jax
from .._higher_order import bodies
from .._modes import MODES
from .._primitive import sow_p
from .._site import Site
from .._sow_index import sites_in

# The plan of a trace that sows per element (see `per_element`), and a number
# of its own. Part of jit's cache key, so no trace is reused across.
_per_element = _jax.trace_value(
    "harvest_lax_map_per_element", "Sites harvest sows once per element of a batched lax.map."
)

# Whether this JAX lets harvest unroll them (else a walk refuses such sows, see `_transforms`).
SUPPORTED = _jax.lax_map_layout() is not None


class Plan(frozenset):
    """The sites, ``{(tag, path)}``, that a batched `lax.map` holds, and `maps`:
    for the number of each of its vmap calls (see the module docstring),
    ``("batches", None)`` or ``("remainder", both)``; None while the calls are
    only being numbered."""

    maps: dict[int, tuple[str, bool | None]] | None

    def __new__(cls, sites: Any = (), maps: dict[int, tuple[str, bool | None]] | None = None):
        plan = super().__new__(cls, sites)
        plan.maps = maps
        return plan


class _Trace(NamedTuple):
    plan: Plan
    number: int  # never repeats: no trace of one plan is reused for another


_traces = itertools.count()

# The number of each vmap call (an AxisData each, not weakly referable) in the
# order a `per_element` trace first batches a sow with it, kept alive while it
# traces so that no id is reused: traces of one function number them alike.
_vmaps: dict[int, tuple[Any, int]] = {}
# The number of the vmap that last unrolled a batched cond's branch sow of each
# (tag, path): that cond's record-only copy after it (see `_rules/batched_cond`),
# one per name and cond whichever branch sows it, counts in its stead.
_in_branch: dict[tuple[Any, ...], int] = {}

# harvest's own code; from a frame of its calling layer outwards, harvest calls
# the function it traces.
_HARVEST = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_CALLING = os.path.join(_HARVEST, "_calling") + os.sep


def staged_per_batch(
    jaxpr: Any, handles: Any = None, retrace: Callable[[Plan], Any] | None = None
) -> Plan:
    """The sites (those ``handles(site)`` accepts; every one for None) that a
    batched `lax.map` stages once per batch in `jaxpr`: the ones to sow once per
    element (reap, plant and `sites` alike). With `retrace`, which traces the
    function again under ``per_element(plan)`` and returns its jaxpr, also the
    plan for that (see the module docstring); it raises where a site is sown in
    a loop inside the map."""
    found = Plan(
        _site_key(eqn.params)
        for eqn in _sown_under_lax_map(jaxpr)
        if handles is None or handles(Site.of(eqn))
    )
    if not found or retrace is None or not SUPPORTED:
        return found
    return _planned(retrace(found), found)


def sown_under_lax_map(jaxpr: Any) -> frozenset[int]:
    """The ids of the sow equations in `jaxpr` (through its bodies) that a batched
    `lax.map` stages."""
    return frozenset(id(eqn) for eqn in _sown_under_lax_map(jaxpr))


def _sown_under_lax_map(jaxpr: Any) -> list[Any]:
    found = _UNDER.get(jaxpr)
    if found is None:
        # JAX records `lax.map`'s frames on some equation around each sow it stages:
        # where none shows them, no frames need reading.
        maybe = any(_jax.recorded_in_lax_map(e.source_info) for e in _staging(jaxpr))
        found = [eqn for eqn, frames, _ in _sows(jaxpr) if _lax_map_parts(frames)] if maybe else []
        _UNDER[jaxpr] = found
    return found


def _staging(jaxpr: Any) -> Iterator[Any]:
    """The sow equations of `jaxpr` (through its bodies) and those holding them."""
    for eqn in jaxpr.eqns:
        inner = [] if eqn.primitive is sow_p else [b for b in bodies(eqn) if sites_in(b.jaxpr)]
        if eqn.primitive is sow_p or inner:
            yield eqn
        for body in inner:
            yield from _staging(body.jaxpr)


_UNDER: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def _planned(jaxpr: Any, plan: Plan) -> Plan:
    """`plan` with its `maps`, from `jaxpr`, traced with the vmap calls numbered."""
    seen: dict[int, set[Any]] = {}
    found = [sow for sow in _sows(jaxpr) if _site_key(sow[0].params) in plan]
    sharing: dict[int, set[int]] = {}
    for eqn, _, _ in found:
        sharing.setdefault(id(eqn.source_info.traceback), set()).add(id(eqn))
    for eqn, frames, nested in found:
        numbers = eqn.params.get("vmaps") or ()
        calls = [i for i, frame in enumerate(frames) if _jax.is_vmap_call(frame)]
        # A body JAX traced once and ran again where it was called (a batched
        # cond's branches) keeps the frames of its first call.
        shared = len(sharing[id(eqn.source_info.traceback)]) > 1
        if (shared and not nested) or len(calls) > len(numbers):
            continue
        # JAX leaves out outer frames only: the innermost calls are the first vmaps.
        for number, i in zip(numbers, calls):
            part = _jax.lax_map_part(frames, i)
            seen.setdefault(number, set()).add(part)
            if part is not None and _jax.traces_a_loop(frames[:i]):
                # A loop in `f` runs each step for the whole batch: sown once per element
                # there, the occurrences would come step by step, not element by element.
                tag, path = _site_key(eqn.params)
                raise ValueError(
                    f"The sow site tag={tag!r}, name={'.'.join(path)!r} runs in a loop (scan, "
                    "while_loop, fori_loop) inside lax.map(f, xs, batch_size=b), which runs each "
                    "step of that loop for the whole batch at once, so its occurrences cannot be "
                    "reaped or planted in element order, as lax.map(f, xs) gives them. Use lax.map "
                    "without batch_size (or jax.vmap) around this function while you harvest it."
                )
    for eqn, _, _ in found:
        if any(len(seen.get(n, ())) != 1 for n in eqn.params.get("vmaps") or ()):
            site = Site.of(eqn)
            raise ValueError(
                f"The sow site tag={site.tag!r}, name={'.'.join(site.path)!r} is sown under "
                "lax.map(f, xs, batch_size=b), inside a vmap whose call JAX recorded nowhere "
                "harvest can read it, so harvest cannot tell whether that vmap is the map's. "
                "Use lax.map without batch_size while you harvest it."
            )
    maps = {n: next(iter(parts)) for n, parts in seen.items() if len(parts) == 1}
    return Plan(plan, {n: part for n, part in maps.items() if part is not None})


def _sows(jaxpr: Any, outer: tuple[_jax.Frame, ...] = ()) -> Iterator[tuple[Any, tuple, bool]]:
    """Each sow equation in `jaxpr` (through its bodies), with its frames and
    those of the equations around it, innermost first, and whether some are."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            yield eqn, _joined(_frames(eqn), outer), bool(outer)
            continue
        inner = [body for body in bodies(eqn) if sites_in(body.jaxpr)]
        if inner:
            here = _joined(_frames(eqn), outer)
            for body in inner:
                yield from _sows(body.jaxpr, here)


def _frames(eqn: Any) -> tuple[_jax.Frame, ...]:
    """The frames JAX recorded for `eqn`, up to where harvest called the traced function."""
    frames = _jax.recorded_frames(eqn.source_info)
    calling = (i for i, f in enumerate(frames) if os.path.abspath(f.file_name).startswith(_CALLING))
    end = next(calling, len(frames))
    return tuple(frames[:end])


def _joined(inner: tuple, outer: tuple) -> tuple:
    """The frames of an equation in a body, then those of the equation holding
    the body. Where JAX recorded the body's frames through a call site (some
    releases record past a jit's entry), that call site's frames come from the
    holder: a body traced once and reused elsewhere (a cond's branch, a jit)
    keeps those of where it was first traced."""
    users = (f for f in outer if not _jax.is_jax_frame(f))
    site = next((f for f in users if not os.path.abspath(f.file_name).startswith(_HARVEST)), None)
    if site is not None and site in inner:
        return inner[: inner.index(site)] + outer[outer.index(site) :]
    return inner + outer


def _lax_map_parts(frames: tuple) -> list[tuple[str, bool | None]]:
    """The parts of batched `lax.map`s whose vmap calls `frames` show."""
    calls = (i for i, frame in enumerate(frames) if _jax.is_vmap_call(frame))
    return [p for i in calls if (p := _jax.lax_map_part(frames, i)) is not None]


@contextlib.contextmanager
def per_element(plan: Any) -> Any:
    """A context for tracing with `plan` (a `Plan` from `staged_per_batch`): the
    vmap calls batching a sow of its sites are numbered, and, once its `maps`
    say which are a batched `lax.map`'s, such a sow fires once per element."""
    global _vmaps, _in_branch
    if not plan:
        yield
        return
    outer, _vmaps, _in_branch = (_vmaps, _in_branch), {}, {}
    try:
        with _per_element(_Trace(Plan(plan, getattr(plan, "maps", None)), next(_traces))):
            yield
    finally:
        _vmaps, _in_branch = outer


def at_level(params: dict[str, Any], axis_data: Any) -> tuple[dict[str, Any], Any]:
    """For a sow with `params` batched now by the vmap of `axis_data`: its params,
    counting that vmap where this trace numbers them, and the part of a batched
    `lax.map` that vmap runs (None if none, or where its sows are not unrolled)."""
    trace = _per_element.value
    if trace is None or _site_key(params) not in trace.plan:
        return params, None
    number = _vmap_number(axis_data)
    params = dict(params, vmaps=(*(params.get("vmaps") or ()), number))
    maps = trace.plan.maps
    return params, (None if maps is None else maps.get(number))


def _batch(jax_rule: Any, axis_data: Any, args: list[Any], dims: list[Any], **params: Any) -> Any:
    params, part = at_level(params, axis_data)
    if part is None or all(d is None for d in dims):
        return jax_rule(axis_data, args, dims, **params)
    vmap: int | None = _vmap_number(axis_data)
    if params.get("role") == "plant_only":  # a batched cond's branch: its copy counts
        _in_branch[_site_key(params)] = _vmap_number(axis_data)
        vmap = None
    per_element = []
    for j in range(axis_data.size):
        row = [
            x if d is None else lax.index_in_dim(x, j, d, keepdims=False)
            for x, d in zip(args, dims)
        ]
        params_j = element_params(params, j, axis_data.size, part, vmap)
        per_element.append(sow_p.bind(*row, **params_j))
    outs = [jnp.stack(leaves) for leaves in zip(*per_element)]
    return outs, [0] * len(outs)


def element_params(
    params: dict[str, Any], j: int, size: int, part: Any, vmap: int | None = None
) -> dict[str, Any]:
    """`params` of a sow unrolled here, for element `j` of a batch of `size` in
    the `part` of a batched `lax.map` (see `at_level`): a collect sow's say which
    (its entries, one per element, are merged into the one entry `lax.map(f, xs)`
    stacks; see `_occurrences.merged_elements`); a rows sow's, which `vmap` of `f`
    unrolled it (see `_run_walk._refuse_sown_twice_per_element`; a batched cond's
    record-only copy: the vmap of the branch sow it copies)."""
    mode = MODES[params["mode"]]
    if mode.entries:
        return dict(params, element=(j, size, *part))
    if mode.rows and params.get("role") != "plant_only":
        vmap = _in_branch.get(_site_key(params)) if vmap is None else vmap
    if mode.rows and vmap is not None:
        return dict(params, element=(j, vmap))
    return params


def _site_key(params: dict[str, Any]) -> tuple[Any, ...]:
    return (params["tag"], params["scope"] + (params["name"],))


def _vmap_number(axis_data: Any) -> int:
    return _vmaps.setdefault(id(axis_data), (axis_data, len(_vmaps)))[1]


_jax.wrap_batching(sow_p, _batch)
