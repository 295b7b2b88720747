"""`lax.map(f, xs, batch_size=b)`: its sows, one per element, as without `batch_size`.

JAX runs such a map as a scan over batches of `b` elements, `f` vmapped over
each batch, then `f` vmapped over the remainder. A sow in `f` would fire once
per batch with a `[b, ...]` value, so what is reaped, and which plant row
lands where, would depend on `b`, a memory knob. Instead, where a walk handles
such a sow, `f` is traced again (`_transforms`) with the sow's batching rule
unrolled: each batch binds one sow per element, in element order, and stacks
their values back into the batch. The walk then sees exactly the occurrences
of `lax.map(f, xs)`: one per element, the remainder's last, each element's own
value (a callable plant sees one element). The unrolled program holds `b`
sows per batch, one equation each. A collect sow's entries, one per element,
carry which element they are (the sow's `element` param), so that the walk
merges them into the one entry per sow that `lax.map(f, xs)` stacks
(`_occurrences.merged_elements`) and splits a plant given so back. A sow in a
loop inside `f` (a scan, a while_loop, another lax.map) is refused: the loop
runs each step for the whole batch, so its occurrences would come step by
step, not element by element. So is a name of a rows mode sown more than once
per element: its rows would come sow by sow within a batch. Its unrolled sows
carry which vmap of `f` unrolled them, for the walk to count them.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import jax.numpy as jnp
from jax import lax

from ... import _jax
from .._modes import MODES
from .._primitive import sow_p, tracing_a_harvest
from .._site import Site
from .._sow_index import sow_index

# The (tag, path) of the sites unrolled per element where a batched lax.map stages
# them. Part of jit's cache key, so no trace is reused across.
_per_element = _jax.trace_value(
    "harvest_lax_map_per_element", "Sites harvest sows once per element of a batched lax.map."
)

# Whether this JAX lets harvest unroll them (else a walk refuses such sows, see `_transforms`).
SUPPORTED = _per_element is not None


# Which vmap of `f` unrolled a rows sow: a number per AxisData (one per vmap call,
# not weakly referable), kept alive while a `per_element` context traces so that
# no id is reused; the numbers never repeat, as jit may reuse an earlier trace.
_vmaps: dict[int, tuple[Any, int]] = {}
_numbers = itertools.count()
# The number of the vmap that last unrolled a batched cond's branch sow of each
# (tag, path): that cond's record-only copy after it (see `_rules/batched_cond`),
# one per name and cond whichever branch sows it, counts in its stead.
_in_branch: dict[tuple[Any, ...], int] = {}


def staged_per_batch(jaxpr: Any, handles: Any = None) -> frozenset[tuple[Any, tuple[str, ...]]]:
    """`(tag, path)` of the sites (those ``handles(site)`` accepts; every one for None)
    a batched `lax.map` stages once per batch in `jaxpr`: the ones to sow once per
    element (reap, plant and `sites` alike)."""
    found: set[tuple[Any, tuple[str, ...]]] = set()
    for item in sow_index(jaxpr).listing:
        site = Site.of(item.eqn)
        if (handles is None or handles(site)) and _jax.staged_by_batched_lax_map(
            item.eqn.source_info
        ):
            found.add((site.tag, site.path))
    return frozenset(found)


@contextlib.contextmanager
def per_element(sites: frozenset) -> Any:
    """A context in which traced sows of `sites`, ``{(tag, path)}``, staged under a
    batched `lax.map`'s vmap, fire once per element of the batch."""
    global _vmaps, _in_branch
    if _per_element is None:
        yield
        return
    outer, _vmaps, _in_branch = (_vmaps, _in_branch), {}, {}
    try:
        with _per_element(sites or None):
            yield
    finally:
        _vmaps, _in_branch = outer


def unrolled_here(params: dict[str, Any], axis_data: Any = None) -> bool:
    """Whether a sow with `params`, batched now (by the vmap of `axis_data`, where
    known), is to be sown once per element (refusing one in a loop inside `f`,
    whose steps run for the whole batch). A vmap around the map batches it as any
    sow, though in the map's remainder it runs under the map's frames too."""
    sites = _per_element.value if _per_element is not None else None
    if not sites or _site_key(params) not in sites:
        return False
    where = _jax.running_under_batched_lax_map(axis_data)
    if where == "loop":
        # A loop in `f` runs each step for the whole batch: sown once per element
        # there, the occurrences would come step by step, not element by element.
        name = ".".join((*params["scope"], params["name"]))
        raise ValueError(
            f"The sow site tag={params['tag']!r}, name={name!r} runs in a loop (scan, "
            "while_loop, fori_loop) inside lax.map(f, xs, batch_size=b), which runs each step of "
            "that loop for the whole batch at once, so its occurrences cannot be reaped or planted "
            "in element order, as lax.map(f, xs) gives them. Use lax.map without batch_size (or "
            "jax.vmap) around this function while you harvest it."
        )
    return where is not None


def _batch(jax_rule: Any, axis_data: Any, args: list[Any], dims: list[Any], **params: Any) -> Any:
    if all(d is None for d in dims):
        return jax_rule(axis_data, args, dims, **params)
    if not unrolled_here(params, axis_data):
        with marking_batched(axis_data):
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
        params_j = element_params(params, j, axis_data.size, vmap, axis_data)
        per_element.append(sow_p.bind(*row, **params_j))
    outs = [jnp.stack(leaves) for leaves in zip(*per_element)]
    return outs, [0] * len(outs)


def element_params(
    params: dict[str, Any], j: int, size: int, vmap: int | None = None, axis_data: Any = None
) -> dict[str, Any]:
    """`params` of a sow unrolled here, for element `j` of a batch of `size`: a
    collect sow's say which (its entries, one per element, are merged into the
    one entry `lax.map(f, xs)` stacks; see `_occurrences.merged_elements`); a
    rows sow's, which `vmap` of `f` unrolled it (see `_run_walk._refuse_sown_twice_per_element`;
    a batched cond's record-only copy: the vmap of the branch sow it copies)."""
    mode = MODES[params["mode"]]
    if mode.entries:
        part = _jax.running_under_batched_lax_map(axis_data)
        both = _jax.batched_lax_map_has_both_parts(axis_data)
        return dict(params, element=(j, size, part, both))
    if mode.rows and params.get("role") != "plant_only":
        vmap = _in_branch.get(_site_key(params)) if vmap is None else vmap
    if mode.rows and vmap is not None:
        return dict(params, element=(j, vmap))
    return params


def _site_key(params: dict[str, Any]) -> tuple[Any, ...]:
    return (params["tag"], params["scope"] + (params["name"],))


def _vmap_number(axis_data: Any) -> int:
    if id(axis_data) not in _vmaps:
        _vmaps[id(axis_data)] = (axis_data, next(_numbers))
    return _vmaps[id(axis_data)][1]


def marking_batched(axis_data: Any = None) -> Any:
    """A context for staging a sow batched, as one sow per batch: where a harvest
    traces under a batched `lax.map`, it is marked, so that the walk sees where
    (JAX keeps no `lax.map` frame for a sow nested in a body `f` traces, a jit's
    or a scan's) and traces it again, to sow it once per element (or refuse it,
    in a loop)."""
    if tracing_a_harvest() and _jax.running_under_batched_lax_map(axis_data):
        return _jax.marking_batched_lax_map()
    return contextlib.nullcontext()


_jax.wrap_batching(sow_p, _batch)
