"""The `sow` primitive: an identity that leaves a named marker in a jaxpr.

Every rule here is the identity on values; the marker matters only to the
interpreter (`_interpreter.py`), which walks the jaxpr. To survive until then:

* While a harvest traces the function it will walk (`tracing_for_harvest`), a
  sow carries an effect, so dead-code elimination or partial evaluation (`grad`
  of a `scan`, say) cannot remove a bare `sow`. Elsewhere it carries none: any
  effect turns off jit's fast C++ dispatch, and an unharvested sow must cost
  nothing. The flag is part of the trace-cache key, so a `jax.jit` traced
  outside a harvest is traced afresh, with the effect, inside one.
* Its JVP (and `jet`) re-binds it on primals only: reap of a differentiated
  function sees each forward value once. Under `jax.linear_transpose`, which
  computes no forward value, the site sows what flows through it: the cotangent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from .. import _jax
from ._modes import MODES

# Params: `mode` names a mode of `_modes.MODES`. `vmapped` (absent: none)
# counts, per leaf, the leading axes vmaps around the sow put in front, so one
# per-example plant can be broadcast. `role` (absent: both) splits a sow in a
# branch vmap runs for every example (see `_rules/batched_cond.py`):
# "plant_only" takes plants where it stands; "record_only", sown after the
# select, records and carries a trailing flag (whether the taken branch sowed
# it). `axes` (absent: none) names each leaf's axes (Penzai's, for `sites`).
# `element` (absent: none) marks a sow a batched `lax.map` unrolled (see
# `_rules/batched_lax_map.py`): `(j, size, part, both)` for collect (see
# `_occurrences.Element`), `(j, vmap)` for append (element `j` of the vmap call
# numbered `vmap`, to refuse a name sown twice per element). `vmaps` (absent:
# not counted) numbers, innermost first, the vmap calls that batched the sow.


class SowEffect(_jax.Effect):
    """Marks `sow` as effectful, while a harvest traces, so dead-code elimination keeps it."""

    def __hash__(self):
        return hash(type(self))

    def __eq__(self, other):
        return type(self) is type(other)

    def __repr__(self):
        return "Sow"


sow_effect = SowEffect()
_jax.allow_effect(SowEffect)

_harvest_tracing = _jax.trace_flag(
    "harvest_tracing", "Set by harvest while it traces a function to walk; gives `sow` its effect."
)


def tracing_for_harvest():
    """A context in which traced sows carry their effect: wrap the tracing of
    every function a harvest will walk (or search for sows) in it."""
    return _harvest_tracing(True)


def tracing_a_harvest() -> bool:
    """Whether a harvest is tracing now (inside `tracing_for_harvest`)."""
    return bool(_harvest_tracing.value)


# The (tag, path) of the sites that `vmap` batches even where their value does not
# depend on the batched input: a plant holding one value per example asks for it
# (see `_transforms`). Part of jit's cache key, so no trace is reused across.
_batched_sites = _jax.trace_value(
    "harvest_batched_sites", "Sites harvest batches under every vmap around them."
)


def batching_sites(sites: frozenset) -> Any:
    """A context in which traced sows of `sites`, ``{(tag, path)}``, are batched
    by every vmap around them (their value broadcast), so a plant can hold one
    value per example."""
    return _batched_sites(sites or None)


def _batched_here(tag: Any, path: tuple) -> bool:
    sites = _batched_sites.value
    return sites is not None and (tag, path) in sites


# A handler every `sow_p.bind` consults first, set while a custom_vjp's backward
# rule re-runs a body with plants in it (see `_rules/calls`): the sows it
# plants bind as the plant applied, before any transformation sees them, so
# the rule differentiates the planted function. Part of jit's cache key, so
# no jitted function inside the rule reuses a trace made without it.
_bind_handler = _jax.trace_value(
    "harvest_sow_bind_handler", "What harvest binds a sow as, inside a custom_vjp's rule."
)


def sows_bound_by(handler: Callable[[tuple, dict], Any]) -> Any:
    """A context in which each `sow_p.bind(*args, **params)` first asks
    ``handler(args, params)`` for its outputs (None: bind as usual)."""
    return _bind_handler(handler)


class _SowPrimitive(_jax.Primitive):
    def bind(self, *args: Any, **params: Any) -> Any:
        handler = _bind_handler.value
        if handler is not None:
            with _bind_handler(None):  # what the handler binds is bound as usual
                out = handler(args, params)
            if out is not None:
                return out
        return super().bind(*args, **params)


sow_p = _SowPrimitive("sow")
sow_p.multiple_results = True


def _has_pred(mode, role=None):
    # `sow_cond` sites, and record-only sows, carry a predicate as a trailing operand.
    return MODES[mode].has_pred or role == "record_only"


def _sow_impl(*args, mode, role=None, **_):
    return list(args[:-1] if _has_pred(mode, role) else args)


def _sow_abstract_eval(*avals, mode, role=None, **_):
    outs = avals[:-1] if _has_pred(mode, role) else avals
    # `instrument`'s sows replace a value that flows on, so they are never bare
    # and need no effect to survive, even while a harvest traces.
    effects = {sow_effect} if _harvest_tracing.value and not MODES[mode].replaces_value else set()
    return list(outs), effects


def _sow_lowering(ctx, *args, **params):
    return _sow_impl(*args, **params)


def _sow_jvp(primals, tangents, **params):
    out = sow_p.bind(*primals, **params)  # a predicate's tangent is dropped with it
    return out, [_jax.instantiate_zeros(t) for t in tangents[: len(out)]]


def _sow_transpose(cts, *args, **params):
    # Only the sown leaves are linear; a sow_cond predicate is a known primal.
    pred = list(args[-1:]) if _has_pred(params["mode"], params.get("role")) else []
    out = sow_p.bind(*[_jax.instantiate_zeros(ct) for ct in cts], *pred, **params)
    return [*out, *(None for _ in pred)]


def _sow_jet(primals, series, **params):
    out = sow_p.bind(*primals, **params)
    return out, series[: len(out)]


def _sow_batch(axis_data, args, dims, **params):
    # Batched leaves get the batch axis in front, so a value reaped from a
    # vmapped function leads with it; unbatched leaves stay unbatched, so sow
    # never changes what vmap (or jacfwd, hessian) sees. Other params (a sow a
    # batched `lax.map` unrolled keeps its `element`) pass through.
    path = params["scope"] + (params["name"],)
    if (_has_pred(params["mode"], params.get("role")) and dims[-1] is not None) or (
        any(d is None for d in dims) and _batched_here(params["tag"], path)
    ):
        # A batched predicate picks per example (or a plant is given per example),
        # so every leaf becomes per example.
        args = [_jax.bdim_at_front(a, d, axis_data) for a, d in zip(args, dims)]
        dims = [0] * len(args)
    args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    n = params["tree"].num_leaves
    vmapped = params.get("vmapped") or (0,) * n
    params = dict(params, vmapped=tuple(k + (d is not None) for k, d in zip(vmapped, dims)))
    if params.get("axes") is not None:  # the batch axis in front has no name
        params["axes"] = tuple(
            names if d is None else (None, *names) for names, d in zip(params["axes"], dims)
        )
    return sow_p.bind(*args, **params), [None if d is None else 0 for d in dims[:n]]


sow_p.def_impl(_sow_impl)
sow_p.def_effectful_abstract_eval(_sow_abstract_eval)
_jax.register_lowering(sow_p, _sow_lowering)
_jax.jvp_rules[sow_p] = _sow_jvp
_jax.transpose_rules[sow_p] = _sow_transpose
_jax.jet_rules[sow_p] = _sow_jet
_jax.register_batching(sow_p, _sow_batch)
